"""Matrix optimizers on shards (issue 33): ``whole_param_step`` steps each sharded parameter whole on one owning rank,
so Muon and Adafactor give the unsharded optimizer's weights, ``torch.equal``, at 1, 2 and 4 ranks, for both entry
points (``fully_shard``; the FSDP class with ``use_orig_params`` True and False), with accumulation and clipping.

The reference is the same optimizer, unsharded, stepped on the sharded run's own (whole) gradients at every step:
what is compared is the step itself, which must be bitwise the unsharded one by construction.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fullshard import FSDP, CPUOffload, MixedPrecisionPolicy, fully_shard
from fullshard.algorithms.whole_step import register_matrix_optimizer, whole_param_step
from fullshard.engine.optim_state import full_optim_state_dict, scatter_full_optim_state_dict
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, make_batch
from fullshard.testing.parity import invariant_gpt

STEPS, ACCUMULATE, MAX_NORM = 3, 2, 0.5


class MLP(nn.Module):
    """Odd sizes: no dim 0 divides 2 or 4 (rank 3 of 4 holds no row of the 5-row head)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 11)
        self.hidden = nn.Linear(11, 9)
        self.head = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.inp(x)))))


class TinyShampoo(torch.optim.Optimizer):
    """A user's matrix optimizer: left/right statistics of each whole 2-D gradient (a toy Shampoo), a 0-dim step
    counter and a python int; every state but the counter is shaped unlike the parameter."""

    def __init__(self, params: object, lr: float = 0.05, eps: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["left"] = torch.zeros(g.shape[0], g.shape[0], dtype=g.dtype)
                    state["right"] = torch.zeros(g.shape[1], g.shape[1], dtype=g.dtype)
                    state["step"] = torch.tensor(0.0)
                    state["count"] = 0
                state["left"].add_(g @ g.T)
                state["right"].add_(g.T @ g)
                state["step"] += 1
                state["count"] += 1
                scale = (state["left"].diagonal().sum() + state["right"].diagonal().sum() + group["eps"]).rsqrt()
                p.add_(g, alpha=-group["lr"] * float(scale))


register_matrix_optimizer(TinyShampoo)


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    if kind == "muon":  # Muon for the 2-D matrices, AdamW for the rest, as users set it up
        matrices = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.05, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(rest, lr=0.01)]
    if kind == "muon-late":  # Muon over the first matrix; the others come in a param group added later
        matrices = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        return [torch.optim.Muon(matrices[:1], lr=0.05), torch.optim.AdamW(rest, lr=0.01)]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=0.05)]
    matrices = [p for p in params if p.ndim == 2]
    return [TinyShampoo(matrices), torch.optim.SGD([p for p in params if p.ndim != 2], lr=0.01)]


def _shard(model: nn.Module, entry: str) -> nn.Module:
    if entry.startswith("fully_shard"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if entry.endswith("-mp") else None
        # -dim1: matrices placed Shard(1) (columns split over ranks; see [Note: Shard(d)])
        place = (lambda p: Shard(1) if p.ndim == 2 else None) if entry.endswith("-dim1") else None
        for block in (model.inp, model.hidden, model.head):
            fully_shard(block, mp_policy=policy, shard_placement_fn=place)
        return fully_shard(model, mp_policy=policy, shard_placement_fn=place)
    kwargs: dict[str, object] = {}
    if entry == "fsdp-hybrid":  # (replicate, shard): 1 -> (1, 1), 2 -> (2, 1), 4 -> (2, 2)
        world = torch.distributed.get_world_size()
        kwargs = {
            "sharding_strategy": "HYBRID_SHARD",
            "device_mesh": init_device_mesh("cpu", (min(world, 2), max(1, world // 2))),
        }
    if entry == "fsdp-offload":
        kwargs = {"cpu_offload": CPUOffload(offload_params=True)}
    return FSDP(model, use_orig_params=entry == "fsdp-orig", auto_wrap_policy=lambda m, r, n: False, **kwargs)


def _full(model: nn.Module, grads: bool = False) -> list[torch.Tensor]:
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, with_grads=grads):
            return [(p.grad if grads else p).detach().clone() for p in model.parameters()]
    out = []
    for p in model.parameters():
        t = p.grad if grads else p
        # contiguous, as an unsharded run has them (a Shard(1) full_tensor() may come back as a movedim view)
        out.append(
            (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone(memory_format=torch.contiguous_format)
        )
    return out


def train(rank: int, world: int, kind: str, entry: str) -> list[str]:
    """Train sharded and, on the same whole gradients, unsharded; return what differs (nothing, bitwise)."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    model = _shard(model, entry)
    optimizers = _optimizers(model, kind)
    for opt in optimizers:
        whole_param_step(model, opt)
    ref_optimizers = _optimizers(reference, kind)
    if kind == "muon-late":  # after the hook: it plans its owners again at the next step
        for opt, m in ((optimizers[0], model), (ref_optimizers[0], reference)):
            opt.add_param_group({"params": [p for p in m.parameters() if p.ndim == 2][1:], "lr": 0.02})
    differ = []
    for step in range(STEPS):
        for k in range(ACCUMULATE):  # this rank's micro-batches, accumulated
            g = torch.Generator().manual_seed(100 * step + 10 * k + rank)
            x, y = torch.randn(3, 6, generator=g), torch.randn(3, 5, generator=g)
            skip_sync = entry == "fsdp-no_sync" and k < ACCUMULATE - 1
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
        differ += _clip_step_both_and_compare(model, reference, optimizers + ref_optimizers, step)
    for opt, ref_opt in zip(optimizers, ref_optimizers, strict=True):
        differ += _state_differs(model, opt, ref_opt)
        differ += _round_trip_differs(model, opt, rank)  # Shard(1) included (its states were scattered wrongly)
    return differ


def _clip_step_both_and_compare(
    model: nn.Module, reference: nn.Module, optimizers: list[torch.optim.Optimizer], step: int
) -> list[str]:
    """Clip the sharded gradients, hand their full tensors to the unsharded ``reference``, step every optimizer (the
    sharded model's and the reference's); the parameters that are not ``torch.equal`` to the reference's, named."""
    model.clip_grad_norm_(MAX_NORM)
    for p, grad in zip(reference.parameters(), _full(model, grads=True), strict=True):
        p.grad = grad
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return [
        f"step {step} {name}: max diff {float((got - want).abs().max().detach()):.3g}"
        for (name, want), got in zip(reference.named_parameters(), _full(model), strict=True)
        if not torch.equal(got, want)
    ]


def _round_trip_differs(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> list[str]:
    """The full state dict held by rank 0 alone, scattered back into the optimizer: this rank's state as it was."""
    before = opt.state_dict()
    full = full_optim_state_dict(model, opt)  # rank0_only
    opt.load_state_dict(scatter_full_optim_state_dict(full if rank == 0 else None, model, optim=opt))
    after = opt.state_dict()
    differ = [] if before["param_groups"] == after["param_groups"] else ["param groups differ after the round trip"]
    for key, state in before["state"].items():
        for name, value in state.items():
            got = after["state"][key][name]
            if isinstance(value, DTensor):
                value, got = value.to_local(), got.to_local()
            same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
            if not same:
                differ.append(f"state {name} of parameter {key} differs after the round trip")
    return differ


def _state_differs(model: nn.Module, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer) -> list[str]:
    """The full optimizer state dict (per-element states gathered, whole ones as they are) against the unsharded
    optimizer's state, value by value."""
    full = full_optim_state_dict(model, opt, rank0_only=False)
    differ = []
    for group, ref_group in zip(full["param_groups"], ref_opt.param_groups, strict=True):
        for fqn, ref_param in zip(group["params"], ref_group["params"], strict=True):
            want = ref_opt.state[ref_param]
            got = full["state"].get(fqn, {})
            if sorted(got) != sorted(want):
                differ.append(f"state of {fqn}: names {sorted(got)} != {sorted(want)}")
                continue
            for name, value in want.items():
                same = torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
                if not same:
                    differ.append(f"state {name} of {fqn} differs")
    return differ


ENTRIES = ["fully_shard", "fsdp-orig", "fsdp-flat"]
# mixed precision (bf16 compute, fp32 sharded parameters: the optimizer's), HSDP, CPU offload, no_sync(), Shard(1)
MORE_ENTRIES = ["fully_shard-mp", "fsdp-hybrid", "fsdp-offload", "fsdp-no_sync", "fully_shard-dim1"]


@pytest.fixture(scope="module")
def runs(pool1: WorkerPool, pool2: WorkerPool, pool4: WorkerPool) -> dict[tuple[int, str, str], list[list[str]]]:
    cases = [(kind, entry) for kind in ("muon", "adafactor", "shampoo") for entry in ENTRIES]
    cases += [(kind, entry) for kind in ("muon", "adafactor") for entry in MORE_ENTRIES]
    cases += [("muon-late", "fully_shard")]
    return {
        (n, kind, entry): pool.run(train, kind, entry)
        for n, pool in ((1, pool1), (2, pool2), (4, pool4))
        for kind, entry in cases
    }


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", ["muon", "adafactor", "shampoo"])
def test_matrix_optimizer_bitwise_unsharded(runs: dict, world: int, entry: str, kind: str) -> None:
    """Muon (+ AdamW), Adafactor and a user's registered matrix optimizer: every rank's weights after every step
    are torch.equal to the unsharded optimizer's on the same gradients."""
    for rank, differ in enumerate(runs[(world, kind, entry)]):
        assert differ == [], f"{kind}, {entry}, {world} ranks, rank {rank}: {differ}"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("entry", MORE_ENTRIES)
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_matrix_optimizer_bitwise_with_precision_hybrid_offload(runs: dict, world: int, entry: str, kind: str) -> None:
    for rank, differ in enumerate(runs[(world, kind, entry)]):
        assert differ == [], f"{kind}, {entry}, {world} ranks, rank {rank}: {differ}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_param_group_added_after_the_hook(runs: dict, world: int) -> None:
    for rank, differ in enumerate(runs[(world, "muon-late", "fully_shard")]):
        assert differ == [], f"{world} ranks, rank {rank}: {differ}"


# --- refusals ------------------------------------------------------------------------------------------------


def step_without(rank: int, world: int, kind: str, entry: str) -> str:
    torch.manual_seed(0)
    model = _shard(MLP(), entry)
    opt = _optimizers(model, kind)[0]
    model(torch.randn(2, 6)).sum().backward()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    return "stepped"


@pytest.mark.parametrize(
    ("kind", "entry"), [("muon", "fully_shard"), ("adafactor", "fsdp-flat"), ("shampoo", "fsdp-orig")]
)
def test_matrix_optimizer_on_shards_refused_without_whole_steps(pool2: WorkerPool, kind: str, entry: str) -> None:
    """Without whole_param_step, a known (or registered) matrix optimizer refuses its first step, on every rank."""
    name = {"muon": "Muon", "adafactor": "Adafactor", "shampoo": "TinyShampoo"}[kind]
    for message in pool2.run(step_without, kind, entry):
        assert message.startswith(f"{name}.step() over ")
        assert "fullshard.whole_param_step(model, optimizer)" in message


def bad_calls(rank: int, world: int) -> list[str]:
    model = _shard(MLP(), "fully_shard")
    opt = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2])
    other = torch.optim.Muon([nn.Parameter(torch.zeros(3, 3))])
    messages = []
    for call in (
        lambda: register_matrix_optimizer(object),  # type: ignore[arg-type]
        lambda: whole_param_step(model, object()),  # type: ignore[arg-type]
        lambda: whole_param_step(model, other),
        lambda: (whole_param_step(model, opt), opt.step(lambda: 0.0)),
    ):
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_bad_calls_name_the_fix(pool1: WorkerPool) -> None:
    got = pool1.run(bad_calls)[0]
    assert got[0].startswith("register_matrix_optimizer(cls=<class 'object'>): expected a subclass of")
    assert got[1].startswith("whole_param_step(optimizer=object): expected a torch.optim.Optimizer")
    assert re.match(
        r"whole_param_step\(model, optimizer=Muon\): the optimizer holds a parameter of shape \(3, 3\)", got[2]
    )
    assert got[3].startswith("Muon.step(closure=...) with whole-parameter steps: a closure would recompute")


# --- world-size-invariant mode, save_state on 2 ranks and load_state on 1 and 4 --------------------------------

INV_CFG = GPTConfig(n_embd=40, n_head=4)
G, MICRO_ROWS, SAVE_AT, INV_STEPS = 4, 2, 2, 4


def _invariant_optimizers(model: nn.Module, kind: str, lr_scale: float) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    if kind == "adafactor":
        return [torch.optim.Adafactor([p for _, p in named], lr=0.02 * lr_scale)]
    hidden = [p for n, p in named if p.ndim == 2 and "blocks" in n]  # Muon: the blocks' matrices
    rest = [p for n, p in named if not (p.ndim == 2 and "blocks" in n)]
    return [torch.optim.Muon(hidden, lr=0.02 * lr_scale), torch.optim.AdamW(rest, lr=0.01 * lr_scale)]


def invariant_run(rank: int, world: int, kind: str, entry: str, root: str, mode: str) -> dict[str, torch.Tensor]:
    """``mode``: "straight" (every step), "save" (SAVE_AT steps, then save_state) or "resume" (load, the rest),
    through the front end's save_state / load_state (SHARDED_STATE_DICT: DCP)."""
    from fullshard import FullyShardedDataParallelPlugin
    from fullshard.frontend.saving import state_io

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2 if entry == "fully_shard" else 1, state_dict_type="SHARDED_STATE_DICT"
    )
    model = invariant_gpt(entry, INV_CFG, G, seed=9 if mode == "resume" else 0)
    optimizers = _invariant_optimizers(model, kind, 10.0 if mode == "resume" else 1.0)
    for opt in optimizers:
        whole_param_step(model, opt)
    objects = state_io.TrainingObjects(models=[model], optimizers=optimizers)
    steps = range(INV_STEPS)
    if mode == "resume":
        state_io.load_state(root, objects, plugin)
        steps = range(SAVE_AT, INV_STEPS)
    for step in steps if mode != "save" else range(SAVE_AT):
        x, y = make_batch(INV_CFG, G * MICRO_ROWS, seed=1000 + step)  # the global batch
        per_rank = G // world
        for k in range(per_rank):
            rows = slice((rank * per_rank + k) * MICRO_ROWS, (rank * per_rank + k + 1) * MICRO_ROWS)
            (model(x[rows], y[rows]) / per_rank).backward()
        model.clip_grad_norm_(0.05)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    if mode == "save":
        state_io.save_state(root, objects, plugin)
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("entry", ["fully_shard", "fsdp"])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_invariant_mode_bitwise_across_world_sizes_and_resharded_resume(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, entry: str
) -> None:
    """Invariant mode makes the gradients bitwise equal on any number of ranks; whole-parameter steps keep the
    weights so. The optimizer state saved on 2 ranks (sharded per-element states, whole Adafactor statistics)
    loads on 1 and 4, and training goes on bitwise as the uninterrupted run."""
    root = str(tmp_path / "ckpt")
    straight = {
        n: request.getfixturevalue(f"pool{n}").run(invariant_run, kind, entry, "", "straight") for n in (1, 2, 4)
    }
    want = straight[2][0]
    request.getfixturevalue("pool2").run(invariant_run, kind, entry, root, "save")
    resumed = {n: request.getfixturevalue(f"pool{n}").run(invariant_run, kind, entry, root, "resume") for n in (1, 4)}
    for label, runs in (("straight", straight), ("resumed", resumed)):
        for world, results in runs.items():
            for rank, got in enumerate(results):
                for name, value in want.items():
                    assert torch.equal(got[name], value), f"{label} on {world} ranks, rank {rank}: {name} differs"


# --- through the Accelerator ------------------------------------------------------------------------------


def accelerator_step(rank: int, world: int, version: int, on: bool | None) -> list[str] | str:
    """One Muon + AdamW step prepared by the Accelerator: the unsharded optimizer's weights on the same gradients
    (plugin default), or the refusal (``whole_param_step=False``)."""
    from fullshard import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, whole_param_step=on)
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    muon, adamw = _optimizers(model, "muon")
    model, muon, adamw = accelerator.prepare(model, muon, adamw)
    accelerator.backward(nn.functional.mse_loss(model(torch.randn(3, 6)), torch.randn(3, 5)))
    for p, grad in zip(reference.parameters(), _full(model, grads=True), strict=True):
        p.grad = grad
    try:
        muon.step()
    except RuntimeError as error:
        return str(error)
    adamw.step()
    for opt in _optimizers(reference, "muon"):
        opt.step()
    return [name for (name, want), got in zip(reference.named_parameters(), _full(model)) if not torch.equal(got, want)]


@pytest.mark.parametrize("version", [1, 2])
def test_accelerator_turns_whole_steps_on_for_matrix_optimizers(pool2: WorkerPool, version: int) -> None:
    assert pool2.run(accelerator_step, version, None) == [[], []]
    for message in pool2.run(accelerator_step, version, False):
        assert message.startswith("Muon.step() over 3 sharded parameters")


# --- a (dp, tp) mesh: tensor parallel parameters made whole over both dims ---------------------------------


def train_tp(rank: int, world: int, kind: str) -> list[str]:
    """TinyGPT on a 2x2 (dp, tp) mesh (fc column-wise, fc_out row-wise over tp, uneven splits; every block and the
    root fully_shard over dp), stepped with whole-parameter steps; the unsharded optimizer is stepped on the same
    whole gradients; return what differs after each step (nothing, bitwise)."""
    from tests.compat.test_tensor_parallel import SPEC, _build

    model = _build("gpt", "ours")
    reference = SPEC.model()
    with torch.no_grad():
        for p, whole in zip(reference.parameters(), _full(model), strict=True):
            p.copy_(whole)
    optimizers = _optimizers(model, kind)
    for opt in optimizers:
        whole_param_step(model, opt)
    ref_optimizers = _optimizers(reference, kind)
    dp, per = rank // 2, SPEC.batch // 2
    differ = []
    for step in range(STEPS):
        x, y = SPEC.micro_batches(step)[0]
        model(x[dp * per : (dp + 1) * per], y[dp * per : (dp + 1) * per]).backward()
        differ += _clip_step_both_and_compare(model, reference, optimizers + ref_optimizers, step)
    return differ


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_matrix_optimizer_bitwise_on_dp_tp_mesh(pool4: WorkerPool, kind: str) -> None:
    """Tensor parallel parameters are gathered whole across dp and tp for their owners: every rank's weights after
    every step are torch.equal to the unsharded optimizer's on the same gradients."""
    for rank, differ in enumerate(pool4.run(train_tp, kind)):
        assert differ == [], f"{kind}, 2x2 (dp, tp), rank {rank}: {differ}"


# --- memory: one piece at a time in, whole tensors freed before the way back ------------------------------------


def exchange_trace(rank: int, world: int) -> tuple[list[tuple[int, int]], list[int]]:
    """For each all_to_all of the second step: (received bytes, whole parameters still alive); the sizes of the
    matrices this rank owns."""
    import weakref
    from unittest import mock

    from fullshard.algorithms import whole_step

    torch.manual_seed(0)
    model = _shard(MLP(), "fully_shard")
    muon = _optimizers(model, "muon")[0]
    hook = whole_param_step(model, muon)
    shapes = {n: p.shape for n, p in MLP().named_parameters()}
    owned = [shapes[n].numel() for n, owner in hook.owners.items() if owner == rank]
    wholes: list[weakref.ref] = []
    calls: list[tuple[int, int]] = []
    own, into = whole_step.WholeParamStep._own_whole, whole_step._all_to_all_into

    def own_whole(self: object, e: object, pieces: list[torch.Tensor]) -> None:
        own(self, e, pieces)
        wholes.append(weakref.ref(e.whole))  # type: ignore[attr-defined]

    def all_to_all_into(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], *args: object) -> None:
        calls.append((sum(out_splits), sum(w() is not None for w in wholes)))
        into(out, inp, out_splits, *args)

    with (
        mock.patch.object(whole_step.WholeParamStep, "_own_whole", own_whole),
        mock.patch.object(whole_step, "_all_to_all_into", all_to_all_into),
        # the pipelined exchange of whole tensors (whole_pipeline.py), as Muon with state beyond its momentum gets
        # it; test_whole_step_pipeline.py traces the split one that torch's Muon gets
        mock.patch.object(whole_step.WholeParamStep, "_can_split", lambda self, bucket: False),
    ):
        for _ in range(2):
            calls.clear()
            model(torch.randn(3, 6)).sum().backward()
            muon.step()
            muon.zero_grad()
    return calls, owned


def test_exchange_holds_one_piece_and_frees_wholes_as_it_scatters(pool2: WorkerPool) -> None:
    """The gather receives one piece (parameter, gradient, momentum) of one matrix per all_to_all, straight into its
    whole tensor, so an owner holds no received buffer beside the whole tensors; the scatter sends one piece
    (parameter, momentum) of one matrix per owner and call, and frees an owner's whole tensors slot by slot: the
    step's memory above an element-wise step is the whole tensors, falling as they are sent back."""
    traces = pool2.run(exchange_trace)
    slots = max(len(owned) for _, owned in traces)  # the most matrices one rank owns
    for rank, (calls, owned) in enumerate(traces):
        assert len(calls) == 3 * slots + 2 * slots, calls  # 3 pieces in, 2 out, per slot
        gathers, scatters = calls[: 3 * slots], calls[3 * slots :]
        received = sorted(b for b, _ in gathers if b)
        assert received == sorted(4 * n for n in owned for _ in range(3)), (rank, owned, calls)
        assert all(alive == 0 for _, alive in gathers), (rank, calls)  # none left from the step before
        # slot j's two calls: the whole tensors of slots j.. are alive, those before freed
        alive = [alive for _, alive in scatters]
        assert alive == [max(len(owned) - j, 0) for j in range(slots) for _ in range(2)], (rank, owned, calls)
