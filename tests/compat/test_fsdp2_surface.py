"""torch FSDP2's public surface on ``fully_shard`` (torch 2.13), each feature against torch's own ``fully_shard`` run on
the same ranks, model and data: ``shard_placement_fn`` (``Shard(1)``, ``Shard(-1)``, uneven), the gradient divide
factor, the all-reduce hook, custom collectives, ``reshard_after_forward`` as an int or None,
``unshard(async_op=True)``,
``register_fsdp_forward_method``, ``fully_shard.state``, ``reset_iter_state``, and the accepted no-op setters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import fullshard
from fullshard import FSDPModule, fully_shard
from fullshard.testing import WorkerPool

ATOL, RTOL = 1e-6, 1e-5


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))

    def score(self, x: torch.Tensor) -> torch.Tensor:  # a second entry point (register_fsdp_forward_method)
        return self.forward(x).sum(dim=-1)


def _model(dim: int = 6, hidden: int = 10, layers: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[MLP(dim, hidden) for _ in range(layers)])


def _shard(model: nn.Module, shard_fn, **kwargs) -> nn.Module:
    for block in model:
        shard_fn(block, **kwargs)
    shard_fn(model, **kwargs)
    return model


def _train(model: nn.Module, steps: int = 3, setup=None, dim: int = 6) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few AdamW steps on per-rank data; the losses and the full parameters after them."""
    if setup is not None:
        setup(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        x = torch.randn(4, dim)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return losses, full


def _compare(ours: tuple, theirs: tuple) -> None:
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), atol=ATOL, rtol=RTOL)
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], atol=ATOL, rtol=RTOL, msg=name)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules fully_shard was applied to, ours or torch's."""
    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.dim()), key=lambda d: param.shape[d]))


# --- shard_placement_fn ------------------------------------------------------------------------------------


def _placement_parity(rank: int, world: int, fn_name: str) -> list:
    fns = {"largest": _largest_dim, "last": lambda p: Shard(-1), "none": lambda p: None}
    fn = fns[fn_name]
    ref = _model(hidden=9)  # 9: uneven over 2 ranks on whichever dim holds it
    want = [p.detach().clone() for p in ref.parameters()]
    ours = _shard(copy.deepcopy(ref), fully_shard, shard_placement_fn=fn)
    placements = []
    for (name, param), full in zip(ours.named_parameters(), want):
        assert isinstance(param, DTensor)
        dim = 0 if fn(param) is None else fn(param).dim % param.dim()
        assert param.placements == (Shard(dim),), (name, param.placements)
        assert param.to_local().shape == torch.chunk(full, world, dim=dim)[rank].shape, name
        torch.testing.assert_close(param.full_tensor(), full, atol=0, rtol=0)
        placements.append(dim)
    # The state dict holds the same DTensors, and loads back.
    sd = ours.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    for name, param in ours.named_parameters():  # the state dict's values are the shards themselves, no copies
        assert sd[name].placements == param.placements and sd[name].to_local().data_ptr() == param.to_local().data_ptr()
    # Loading new DTensors of the same layout writes them into the shards (torch's _test_state_dict_save_load).
    saved = {k: v.detach().clone() for k, v in sd.items()}
    ours.load_state_dict({k: v.detach().clone().fill_(42 + rank) for k, v in sd.items()})
    for name, param in ours.named_parameters():
        assert torch.all(param.to_local() == 42 + rank), name
    ours.load_state_dict(saved)
    _compare(_train(ours), _train(_shard(copy.deepcopy(ref), torch_fully_shard)))
    return placements


@pytest.mark.parametrize("fn_name", ["largest", "last", "none"])
def test_shard_placement_fn_matches_torch(pool2: WorkerPool, fn_name: str) -> None:
    placements = pool2.run(_placement_parity, fn_name)[0]
    if fn_name != "none":
        assert 1 in placements  # some parameters really are sharded on dim 1


def _placement_refusals(rank: int, world: int) -> None:
    for bad, needle in ((lambda p: Shard(1), r"bias.*of shape \(4,\)"), (lambda p: "row", r"must return Shard\(dim\)")):
        with pytest.raises(ValueError, match=needle):
            fully_shard(nn.Linear(4, 4), shard_placement_fn=bad)
    with pytest.raises(AssertionError, match="Shard dim 1 is invalid for 1D tensor"):  # what torch raises, too
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1))


def test_shard_placement_fn_refuses_bad_placements(pool2: WorkerPool) -> None:
    pool2.run(_placement_refusals)


# --- numerics of the communication setters ---------------------------------------------------------------


def _divide_factor(rank: int, world: int, deprecated: bool) -> None:
    def setup(model: nn.Module, force_sum: bool = False) -> None:
        for module in _fsdp_modules(model):  # not recursive, in torch as here
            if deprecated:
                module.set_reduce_scatter_divide_factor(0.5)
            else:
                module.set_gradient_divide_factor(0.5)
            # torch on gloo needs sum reductions for a divide factor (gloo has no PREMUL_SUM); fullshard does not
            module.set_force_sum_reduction_for_comms(force_sum)

    if deprecated:
        import warnings

        warnings.simplefilter("ignore")
    ours = _train(_shard(_model(), fully_shard), setup=setup)
    theirs = _train(_shard(_model(), torch_fully_shard), setup=lambda m: setup(m, force_sum=True))
    _compare(ours, theirs)
    plain = _train(_shard(_model(), fully_shard))
    assert not torch.allclose(plain[1]["0.in_proj.weight"], ours[1]["0.in_proj.weight"])  # it changed something


@pytest.mark.parametrize("deprecated", [False, True])
def test_gradient_divide_factor_matches_torch(pool2: WorkerPool, deprecated: bool) -> None:
    pool2.run(_divide_factor, deprecated)


def _one_backward_grads(model: nn.Module, setup=None) -> dict[str, torch.Tensor]:
    if setup is not None:
        setup(model)
    torch.manual_seed(7 + dist.get_rank())
    model(torch.randn(4, 6)).pow(2).sum().backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _all_reduce_hook(rank: int, world: int) -> None:
    calls = []

    def setup(model: nn.Module) -> None:
        def hook(output: torch.Tensor) -> None:
            calls.append(output.numel())
            output.mul_(3.0)  # a hook that changes the gradient: its change must land in .grad

        for module in _fsdp_modules(model):
            module.set_all_reduce_hook(hook)

    ours = _one_backward_grads(_shard(_model(), fully_shard), setup)
    n_ours = len(calls)
    theirs = _one_backward_grads(_shard(_model(), torch_fully_shard), setup)
    assert n_ours == len(calls) - n_ours == 2  # once per unit with parameters (the two blocks; the root has none)
    plain = _one_backward_grads(_shard(_model(), fully_shard))
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=ATOL, rtol=RTOL, msg=name)
        torch.testing.assert_close(ours[name], 3.0 * plain[name], atol=ATOL, rtol=RTOL, msg=name)


def test_all_reduce_hook_matches_torch(pool2: WorkerPool) -> None:
    pool2.run(_all_reduce_hook)


class _Doubling:
    """A custom reduce-scatter (torch's ReduceScatter interface) that doubles what it reduces, and an all-gather
    that counts its calls: what they change must show."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.calls += 1
        if op is None:  # all-gather
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        dist.reduce_scatter_tensor(output_tensor, input_tensor * 2, group=group, op=dist.ReduceOp.SUM)
        return None


def _custom_comms(rank: int, world: int) -> None:
    gather, scatter = _Doubling(), _Doubling()

    def setup(model: nn.Module) -> None:
        for module in _fsdp_modules(model):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)

    ours = _one_backward_grads(_shard(_model(), fully_shard), setup)
    plain = _one_backward_grads(_shard(_model(), fully_shard))
    assert gather.calls >= 2 and scatter.calls == 2
    for name in ours:
        torch.testing.assert_close(ours[name], 2.0 * plain[name], atol=ATOL, rtol=RTOL, msg=name)


def test_custom_collectives_are_used(pool2: WorkerPool) -> None:
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    pool2.run(_custom_comms)


# --- the rest of the surface ---------------------------------------------------------------------------------


def _surface(rank: int, world: int) -> None:
    # reshard_after_forward as None (torch's default) or an int dividing the shard group: same values as torch.
    for value in (None, 2, 1):
        ours = _train(_shard(_model(), fully_shard, reshard_after_forward=value))
        theirs = _train(_shard(_model(), torch_fully_shard, reshard_after_forward=value))
        _compare(ours, theirs)
    with pytest.raises(ValueError, match="divides the shard group"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=3)

    # fully_shard.state: one distinct state per call, None for a module without.
    model = _shard(_model(), fully_shard)
    states = [fully_shard.state(m) for m in (model, model[0], model[1])]
    assert all(s is not None for s in states) and len({id(s) for s in states}) == 3
    assert fully_shard.state(nn.Linear(2, 2)) is None

    # Slicing a sharded Sequential gives a plain Sequential (no unit behind it), as in torch.
    sliced = model[:1]
    assert type(sliced) is nn.Sequential and not isinstance(sliced, FSDPModule)
    # Containers without forward, and meshes of more than 2 dims, are refused with torch's opening words.
    with pytest.raises(ValueError, match="containers that do not implement forward"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="expects a 1D or 2D DeviceMesh"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (world, 1, 1)))

    # deepcopy of a sharded module is refused, as torch refuses it.
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(model)

    # unshard(async_op=True) hands back a handle; the forward after it computes the same as without.
    x = torch.randn(4, 6)
    want = model(x)
    handle = model[0].unshard(async_op=True)
    assert isinstance(handle, fullshard.UnshardHandle)
    handle.wait()
    handle.wait()  # idempotent
    torch.testing.assert_close(model(x), want, atol=0, rtol=0)
    assert model[1].unshard() is None
    model[1].reshard()

    # Accepted setters (scheduling only on CPU): training matches torch with them set.
    def setup(m: nn.Module) -> None:
        m.set_reshard_after_backward(False)
        m.set_is_last_backward(True)
        m.set_requires_all_reduce(False)  # 1-D mesh: nothing to skip
        m.set_modules_to_backward_prefetch([m[0]])
        m.set_modules_to_forward_prefetch([m[1]])
        m[0].set_unshard_in_backward(True)
        m.set_post_optim_event(None)
        m.set_force_sum_reduction_for_comms(True)
        fullshard.share_comm_ctx([m[0], m[1]])

    _compare(_train(_shard(_model(), fully_shard), setup=setup), _train(_shard(_model(), torch_fully_shard)))
    with pytest.raises(ValueError, match="fully_shard applied"):
        fullshard.share_comm_ctx([nn.Linear(2, 2)])


def test_public_surface_matches_torch(pool2: WorkerPool) -> None:
    pool2.run(_surface)


def _forward_method(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = MLP(6, 10)
    x = torch.randn(3, 6)  # the same on both ranks: the averaged gradient is this one's
    want = ref.score(x)
    ref.score(x).sum().backward()
    want_grad = ref.in_proj.weight.grad.clone()
    model = copy.deepcopy(ref)
    model.zero_grad()
    fully_shard(model)
    fullshard.register_fsdp_forward_method(model, "score")
    got = model.score(x)  # gathers the parameters: without registration this would see DTensor shards
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    got.sum().backward()
    torch.testing.assert_close(model.in_proj.weight.grad.full_tensor(), want_grad, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="fully_shard applied first"):
        fullshard.register_fsdp_forward_method(MLP(2, 2), "score")


def test_register_fsdp_forward_method(pool2: WorkerPool) -> None:
    pool2.run(_forward_method)


def _reset_iter_state(rank: int, world: int) -> None:
    model = _shard(_model(), fully_shard)

    class Boom(Exception):
        pass

    def explode(module, args, output):
        raise Boom

    handle = model[1].register_forward_hook(explode)
    with pytest.raises(Boom):
        model(torch.randn(4, 6))
    handle.remove()
    with pytest.raises(RuntimeError, match="not the root"):
        model[0].reset_iter_state()
    model.reset_iter_state()
    # After the reset, training matches a model that never failed.
    _compare(_train(model), _train(_shard(_model(), fully_shard)))


def test_reset_iter_state_after_a_failed_forward(pool2: WorkerPool) -> None:
    pool2.run(_reset_iter_state)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)) * self.scale


def _replaced_after_sharding(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = _Normed()
    nn.init.uniform_(ref.scale)
    x = torch.randn(4, 3)
    ref(x).pow(2).sum().backward()

    # torch's order: build on meta, shard, materialize the blocks, then assign a new parameter on the root.
    with torch.device("meta"):
        model = _Normed()
    for module in (model.layer1, model.layer2, model):
        fully_shard(module)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        for name in ("layer1", "layer2"):
            full = getattr(ref, name).weight.detach()
            getattr(model, name).weight.to_local().copy_(torch.chunk(full, world)[rank])
    model.scale = nn.Parameter(ref.scale.detach().clone())  # a full tensor, assigned after fully_shard
    assert isinstance(model.scale, nn.Parameter) and not isinstance(model.scale, DTensor)
    out = model(x)  # taken in as a shard at the first forward (the root then keeps it gathered, as torch)
    torch.testing.assert_close(out, ref(x), atol=ATOL, rtol=RTOL)
    out.pow(2).sum().backward()
    assert isinstance(model.scale, DTensor)
    for name, param in model.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.full_tensor(), want, atol=ATOL, rtol=RTOL, msg=name)

    # load_state_dict(assign=True) of full tensors onto a meta-device sharded model.
    with torch.device("meta"):
        model = _Normed()
    for module in (model.layer1, model.layer2, model):
        fully_shard(module)
    model.load_state_dict({k: v.detach().clone() for k, v in ref.state_dict().items()}, assign=True)
    torch.testing.assert_close(model(x), ref(x), atol=ATOL, rtol=RTOL)


def test_parameters_replaced_after_sharding(pool2: WorkerPool) -> None:
    pool2.run(_replaced_after_sharding)


def _to_dtype_after_sharding(rank: int, world: int) -> None:
    ref = _model().to(torch.float64)
    model = _shard(_model(), fully_shard)
    model.to(torch.float64)
    for param in model.parameters():
        assert param.dtype == param.to_local().dtype == torch.float64
    losses = []
    for m in (ref, model):
        optim = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(3):
            torch.manual_seed(step)  # the same data on every rank: the sharded average is the reference's gradient
            loss = m(torch.randn(4, 6, dtype=torch.float64)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    assert losses[:3] == pytest.approx(losses[3:], rel=1e-12)
    for (name, param), want in zip(model.named_parameters(), ref.parameters()):
        assert param.grad is None and param.dtype == torch.float64
        torch.testing.assert_close(param.full_tensor(), want, atol=1e-12, rtol=1e-12, msg=name)


def test_module_to_dtype_after_sharding(pool2: WorkerPool) -> None:
    pool2.run(_to_dtype_after_sharding)


def _list_of_modules(rank: int, world: int) -> None:
    ours = _model(layers=3)
    assert fully_shard([ours[1], ours[2]]) == [ours[1], ours[2]]
    fully_shard(ours[0])
    fully_shard(ours)
    assert all(isinstance(m, FSDPModule) for m in ours) and isinstance(ours[1].in_proj.weight, DTensor)
    theirs = _model(layers=3)
    torch_fully_shard([theirs[1], theirs[2]])
    torch_fully_shard(theirs[0])
    torch_fully_shard(theirs)
    _compare(_train(ours), _train(theirs))
    with pytest.raises(TypeError, match="non-empty list"):
        fully_shard([])


def test_fully_shard_list_of_modules_matches_torch(pool2: WorkerPool) -> None:
    pool2.run(_list_of_modules)


class _TiedHead(nn.Module):
    """An embedding and an output head that share one weight, a layer between them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def _tied_list_unit(rank: int, world: int) -> dict[str, int]:
    from unittest.mock import patch

    import fullshard.engine.group as engine_group

    runs, models = {}, {}
    for name, shard in (("ours", fully_shard), ("theirs", torch_fully_shard)):
        torch.manual_seed(0)
        model = models[name] = _TiedHead()
        shard([model.emb, model.head])  # torch's advice for a weight used by two modules: one unit for both
        shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            torch.manual_seed(100 + 10 * step + rank)
            loss = model(torch.randint(0, 16, (4, 3))).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        runs[name] = (losses, {k: v.full_tensor() for k, v in model.state_dict().items()})
    _compare(runs["ours"], runs["theirs"])
    ours = models["ours"]
    assert fully_shard.state(ours.emb) is fully_shard.state(ours.head) is not fully_shard.state(ours)
    assert ours.emb.weight is ours.head.weight and isinstance(ours.head, FSDPModule)
    fresh = _TiedHead()  # the state dict loads into another model sharded the same way, to the same outputs
    fully_shard([fresh.emb, fresh.head])
    fully_shard(fresh)
    fresh.load_state_dict(ours.state_dict())
    x = torch.randint(0, 16, (4, 3))
    with torch.no_grad():
        assert torch.equal(fresh(x), ours(x))
    lone = _TiedHead()  # a list unit with no root above it is refused at its first forward, by name
    fully_shard([lone.emb, lone.head])
    with pytest.raises(ValueError, match=r"fully_shard\(\[Embedding, Linear\]\) ran forward as the root unit"):
        lone(torch.zeros(1, 1, dtype=torch.long))
    gathers = []
    real = engine_group.foreach_all_gather
    with patch.object(engine_group, "foreach_all_gather", lambda *a, **k: gathers.append(1) or real(*a, **k)):
        ours(torch.randint(0, 16, (4, 3))).sum().backward()
    return {"gathers": len(gathers)}


def test_fully_shard_list_is_one_unit_for_a_tied_weight_as_torch(pool2: WorkerPool) -> None:
    # Forward: the root's gather, one for [emb, head] (not one per module); backward: [emb, head] again.
    assert pool2.run(_tied_list_unit) == [{"gathers": 3}, {"gathers": 3}]


def _placement_dcp(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = _shard(_model(hidden=9), fully_shard, shard_placement_fn=_largest_dim)
    want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    # Loaded back into the same layout, and into a dim-0 sharded model (DCP reshards between placements).
    for fn in (_largest_dim, None):
        other = _shard(_model(hidden=9), fully_shard, shard_placement_fn=fn)
        with torch.no_grad():
            for param in other.parameters():
                param.to_local().zero_()
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=path)
        other.load_state_dict(sd)
        for key, value in other.state_dict().items():
            assert torch.equal(value.full_tensor(), want[key]), key


def test_shard_placement_fn_dcp_round_trip(pool2: WorkerPool, tmp_path) -> None:
    pool2.run(_placement_dcp, str(tmp_path))


def _hsdp_requires_all_reduce(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = _model()
    model = _shard(_model(), fully_shard, mesh=mesh)
    batches = []
    for micro in range(2):
        torch.manual_seed(10 * micro + rank)
        batches.append(torch.randn(4, 6))
    # Micro-batch 1 reduce-scatters only; micro-batch 2 all-reduces both sums across the replicas.
    model.set_requires_all_reduce(False)
    model(batches[0]).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # .grad waits for the all-reduce, as in torch
    model.set_requires_all_reduce(True)
    model(batches[1]).pow(2).sum().backward()
    # Reference: every rank's two micro-batches on the unsharded model, averaged over the 4 ranks.
    for b in batches:
        ref(b).pow(2).sum().backward()
    for param in ref.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(world)
    for (name, param), want in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), want.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_hsdp_requires_all_reduce_accumulates(pool4: WorkerPool) -> None:
    pool4.run(_hsdp_requires_all_reduce)


def _placement_bf16_and_clipping(rank: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    from fullshard import MixedPrecisionPolicy

    # hidden=10: torch refuses uneven Shard(1), so the comparison uses even splits.
    ours = _train(
        _shard(
            _model(hidden=10),
            fully_shard,
            shard_placement_fn=_largest_dim,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        )
    )
    theirs = _train(
        _shard(
            _model(hidden=10),
            torch_fully_shard,
            shard_placement_fn=_largest_dim,
            mp_policy=TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16),
        )
    )
    _compare(ours, theirs)
    clipped = []
    for shard_fn in (fully_shard, torch_fully_shard):
        model = _shard(_model(hidden=10), shard_fn, shard_placement_fn=_largest_dim)
        torch.manual_seed(rank)
        model(torch.randn(4, 6)).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.1)
        clipped.append((norm.full_tensor(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    torch.testing.assert_close(clipped[0][0], clipped[1][0], atol=ATOL, rtol=RTOL)
    for name, grad in clipped[0][1].items():
        torch.testing.assert_close(grad, clipped[1][1][name], atol=ATOL, rtol=RTOL, msg=name)


def test_shard_placement_fn_bf16_and_clipping_match_torch(pool2: WorkerPool) -> None:
    pool2.run(_placement_bf16_and_clipping)


# --- parameter registration after forward ------------------------------------------------------------------------


def _registration(model: nn.Module, shard_fn, raf, nested: bool) -> dict[str, list]:
    """Which parameters are DTensors after a forward (autograd on, no backward), after ``state_dict()``, after each
    unit's ``reshard()``, and after a forward and backward; with the values seen after the forward."""

    def kinds() -> list[bool]:
        return [isinstance(p, DTensor) for p in model.parameters()]

    if nested:  # torch's test: two units inside the first block, the root around everything
        shard_fn(model[0].in_proj, reshard_after_forward=raf)
        shard_fn(model[0].out_proj, reshard_after_forward=raf)
    shard_fn(model, reshard_after_forward=raf)
    x = torch.randn(3, 6)
    got = {"before": kinds()}
    model(x)
    got["after_forward"] = kinds()
    got["values"] = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
    for m in _fsdp_modules(model):
        m.reshard()
    got["after_reshard"] = kinds()
    model(x)
    model.state_dict()
    got["after_state_dict"] = kinds()
    model(x).sum().backward()
    got["after_backward"] = kinds()
    for value in (True, False):  # explicit, so it applies to the root too
        model.set_reshard_after_forward(value)
        model(x)
        got[f"after_set_{value}"] = kinds()
    return got


def _registration_like_torch(rank: int, world: int) -> None:
    for nested in (False, True):
        for raf in (True, False, 2, None):
            ref = _model(layers=2)
            want = [p.detach().clone() for p in ref.parameters()]
            ours = _registration(copy.deepcopy(ref), fully_shard, raf, nested)
            theirs = _registration(copy.deepcopy(ref), torch_fully_shard, raf, nested)
            keys = ("before", "after_forward", "after_reshard", "after_state_dict", "after_backward", "after_set_True")
            for key in (*keys, "after_set_False"):
                assert ours[key] == theirs[key], (nested, raf, key, ours[key], theirs[key])
            for got, full in zip(ours["values"], want):
                torch.testing.assert_close(got, full, atol=0, rtol=0)
            # torch's own expectations (test_param_registration_after_forward), spelled out
            if raf is False or (raf is None and not nested):
                assert not any(ours["after_forward"])  # kept gathered: the unsharded tensors, until reshard()
            elif raf is None:
                assert ours["after_forward"] == [True] * 4 + [False] * 4  # the nested units reshard, the root keeps
            else:
                assert all(ours["after_forward"])  # True or 2 (the world): every unit reshards, the root too
            assert all(ours["after_reshard"]) and all(ours["after_backward"]) and all(ours["after_set_True"])
            assert not any(ours["after_set_False"])


def test_param_registration_after_forward_as_torch(pool2: WorkerPool) -> None:
    pool2.run(_registration_like_torch)


def _reapply(rank: int, world: int) -> None:
    sentence = "Each distinct composable distributed API can only be applied to a module once."
    theirs = MLP(4, 4)
    torch_fully_shard(theirs)
    with pytest.raises(AssertionError, match=sentence):
        torch_fully_shard(theirs)
    ours = MLP(4, 4)
    fully_shard(ours)
    for cls in (AssertionError, ValueError):  # torch's class, and ours
        with pytest.raises(cls, match=sentence) as info:
            fully_shard(ours)
        assert "already applied to this MLP" in str(info.value)


def test_fully_shard_reapply_raises_as_torch(pool2: WorkerPool) -> None:
    pool2.run(_reapply)


# --- gradient accumulation without sync under a wider reduce dtype -----------------------------------------------


def _accumulated_grads(model: nn.Module, reshard_after_backward: bool) -> dict[str, torch.Tensor]:
    """Four bf16 micro-batches, gradient sync off but on the last; the sharded gradients after it."""
    for micro in range(4):
        last = micro == 3
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last or reshard_after_backward)
        torch.manual_seed(30 + 10 * micro + dist.get_rank())
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _unsynced_accumulation(rank: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    from fullshard import MixedPrecisionPolicy

    for reshard_after_backward in (True, False):
        mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ours = _accumulated_grads(
            _shard(_model(), fully_shard, mp_policy=MixedPrecisionPolicy(**mp)), reshard_after_backward
        )
        theirs = _accumulated_grads(
            _shard(_model(), torch_fully_shard, mp_policy=TorchMixedPrecisionPolicy(**mp)), reshard_after_backward
        )
        assert ours.keys() == theirs.keys()
        for name, grad in ours.items():
            assert grad.dtype == theirs[name].dtype == torch.float32, name
            torch.testing.assert_close(grad, theirs[name], atol=ATOL, rtol=RTOL, msg=name)


def test_unsynced_micro_batches_sum_in_reduce_dtype_as_torch(pool2: WorkerPool) -> None:
    """bf16 compute, float32 reduce_dtype, sync off for three of four micro-batches: the unsharded gradients sum in
    float32 (torch's FSDP2 does; a bf16 sum was off by up to 30% per element)."""
    pool2.run(_unsynced_accumulation)


# --- torch's replicate() over fully_shard units --------------------------------------------------------------------


class _UnshardsFirst(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self[1].unshard(async_op=True)  # as torch's test_unshard_async does, after replicate's own lazy init
        return super().forward(x)


def _replicate_over_units(rank: int, world: int, unshard_first: bool) -> None:
    from torch.distributed._composable import replicate

    torch.manual_seed(0)
    model = (_UnshardsFirst if unshard_first else nn.Sequential)(nn.Linear(4, 4), MLP(4, 8))
    fully_shard(model[1])
    replicate(model)
    with pytest.raises(ValueError, match=r"replicate\(\)"):
        model(torch.randn(2, 4))


@pytest.mark.parametrize("unshard_first", [False, True])
def test_torch_replicate_over_units_is_refused(pool2: WorkerPool, unshard_first: bool) -> None:
    """torch's replicate() cannot see fullshard's units (torch keeps them in a private registry), so DDP localizes
    their sharded parameters and broadcasts rank 0's shards over the others': refused on every rank, also when the
    unit was gathered with ``unshard(async_op=True)`` before its first forward (that used to train on wrong shards)."""
    pool2.run(_replicate_over_units, unshard_first)
