"""Extension parameters: tensor-subclass parameters that bring their own all-gather (4-bit QLoRA bases, frozen;
subclasses trained under fully_shard, as torch FSDP2's tests train them).

[Note: extension parameters]
A tensor subclass such as torchao's ``NF4Tensor`` holds more than its elements: packed 4-bit codes plus block
scales. Flattening it into a group's ``flat_shard`` would lose those, so such a parameter is sharded on its own,
through the protocol torch's FSDP2 defines for such subclasses (the *extension protocol*):

- ``fsdp_pre_all_gather(mesh)`` (or ``(mesh, outer_size, outer_stride, module, mp_policy)``), called on this
  rank's shard, returns the plain tensors to all-gather (for NF4: codes, quantized scales, scale factors) and
  metadata (everything else: block sizes, the shared scale mean, the shard's shape);
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` rebuilds the full subclass tensor from the
  all-gathered tensors (each ``(world * rows, ...)``, rank-major) and returns it with the tensors to free; called
  again with ``out=`` (that tensor) after a later gather into the same buffers.

The shard is ``torch.chunk(param, world, 0)[rank]`` (the subclass splits its codes and scales by rows together),
copied into storage of its own through ``__tensor_flatten__`` / ``__tensor_unflatten__``. Alive in each state:

- sharded: the shard (its inner tensors), registered on the modules as a frozen ``nn.Parameter``;
- gathered: also one buffer per gathered tensor (``world`` times the shard's) and the full tensor over them,
  registered for compute. Resharding frees the buffers' storage (``resize_(0)``) but keeps the full tensor
  object, so a tensor autograd saved in forward sees the data of the next gather (backward gathers again).

A frozen one (a QLoRA base) gets no gradient, no reduction and no optimizer state; its shard is registered as a
plain ``nn.Parameter`` of its class. A trainable one (torch FSDP2's tests train ``TwoTensor`` weights and weights
gathered in bf16 through the protocol) is sharded as torch's ``fully_shard`` shards it:

- at rest: a ``DTensor`` (``Shard(0)`` on the unit's mesh) over the local subclass shard, the tensor the optimizer
  steps; the hooks are read from that local tensor at each gather, so hooks set on ``param._local_tensor`` after
  sharding are used;
- gathered: the full tensor that ``fsdp_post_all_gather`` returned, registered as an autograd leaf that requires
  grad (the same object every gather, so autograd's accumulation into its ``.grad`` spans a backward, or several
  with gradient sync off, moved at each one's end into a sum in the reduce dtype where that is wider, as a plain
  parameter's: ``hold_unsynced_grads``); the plain tensors the hook named to free (a full tensor upcast from a
  bf16 gather) have their storage freed at reshard and given back before the next gather's ``out=`` call, as the
  buffers';
- after the backward (the root's final callback, gradient sync on): its ``.grad`` (for a wrapper subclass, copied
  into a plain tensor of the unit's reduce dtype, else the parameter's, by the subclass's own ``copy_``; zeros
  where this rank has none) is reduce-scattered over the shard group by rows, all-reduced over the replicas under
  HSDP, divided as a plain parameter's gradient (``collectives.gradient_divide_factors``: the average, or the
  ``set_gradient_divide_factor`` one) and added, in the parameter's dtype, to the sharded parameter's ``.grad``: a
  ``DTensor`` over a plain local tensor (``param.accumulate_sharded_grad``, as a plain parameter's: one no rank
  used keeps ``.grad`` as it was, ``None`` after ``zero_grad()``, and its post-accumulate-grad hooks run).
  Communication hooks, custom reduce-scatters, the all-reduce hook and ``set_requires_all_reduce(False)`` are the
  plain parameters' only.

A frozen subclass without the protocol (bitsandbytes' ``Params4bit``), or a trainable one whose inner tensors hold
integer codes (a trainable ``NF4Tensor``: no gradient can be reduced into it), is refused by name
(:func:`refuse_unshardable`); a trainable wrapper subclass of floating inner tensors is taken without it (torch's
tests set the hooks on the local shard after sharding) and refused at its first gather if it still lacks them. A
frozen one's shards split evenly or it is refused; a trainable one's rows may not (torch's contract: its
``fsdp_pre_all_gather`` pads to ``ceil(rows / world)`` rows, else an input of this rank's rows is padded here; the
gathered tensor is cut back to the parameter's rows). With one rank per shard group nothing is split and nothing
gathered (a trainable one stays the parameter it was, and autograd gives it its gradient); a trainable one is then
refused if the unit has replicas (its gradient would not be all-reduced across them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard.engine import collective_check, trace
from fullshard.engine.collectives import (
    CommOptions,
    PendingReduce,
    all_gather_flat,
    finish_reduce,
    gradient_divide_factors,
    reduce_scatter_flat,
)
from fullshard.engine.mesh import ShardGroup
from fullshard.engine.param import accumulate_sharded_grad, set_owner
from fullshard.engine.precision import widened_sum

__all__ = ["ExtensionParam", "ExtensionParams", "has_protocol", "is_plain", "refuse_unshardable"]

_FIX = (
    "Freeze it and keep its all-gather protocol (param.requires_grad_(False), as PEFT does for the base model; "
    "torchao's NF4Tensor implements fsdp_pre_all_gather/fsdp_post_all_gather), load the base model unquantized "
    "(e.g. in bf16, and train LoRA adapters on it), or leave the quantized modules unsharded (ignored_modules=... or "
    "ignored_params=...)."
)


def _data(param: torch.Tensor) -> torch.Tensor:
    return param.data if isinstance(param, nn.Parameter) else param


def is_plain(param: torch.Tensor) -> bool:
    """A plain tensor or ``DTensor`` parameter: what a group's flat shard holds."""
    if isinstance(param, DTensor) or isinstance(_data(param), DTensor):
        return True
    return type(param) in (nn.Parameter, torch.Tensor) and type(_data(param)) is torch.Tensor


def has_protocol(param: torch.Tensor) -> bool:
    """Whether ``param`` implements torch FSDP2's all-gather extension protocol (both halves)."""
    data = _data(param)
    return callable(getattr(data, "fsdp_pre_all_gather", None)) and callable(
        getattr(data, "fsdp_post_all_gather", None)
    )


def refuse_unshardable(param: nn.Parameter, fqn: str) -> None:
    """Refuse a tensor-subclass parameter that cannot be sharded as an extension parameter, naming it and the fix."""
    if is_plain(param):
        return
    data = _data(param)
    kind = type(data).__name__ if type(data) is not torch.Tensor else type(param).__name__
    if not has_protocol(param) and not (param.requires_grad and _floating_wrapper(data)):
        raise ValueError(
            f"parameter {fqn!r} is a {kind} ({param.dtype}), a tensor subclass such as a 4-bit quantized weight "
            "(QLoRA) without torch FSDP2's all-gather protocol (fsdp_pre_all_gather/fsdp_post_all_gather); "
            "fullshard shards plain tensors, DTensors and subclasses with that protocol only, and would lose "
            f"its quantization metadata. {_FIX}"
        )
    coded = [n for n, t in _inner(data) if not (t.is_floating_point() or t.is_complex())]
    if param.requires_grad and coded:
        raise ValueError(
            f"parameter {fqn!r} is a {kind} ({param.dtype}) with requires_grad=True whose inner tensors {coded} hold "
            "integer data (quantized codes): a gradient cannot be reduced into it nor an optimizer step it (fullshard "
            f"trains tensor-subclass parameters whose inner tensors are floating point, such as TwoTensor). {_FIX}"
        )


def _floating_wrapper(tensor: torch.Tensor) -> bool:
    """A traceable wrapper subclass whose inner tensors are all floating point (``TwoTensor``): trainable without
    the protocol at sharding, as torch reads the hooks from the local shard at each gather (see the note)."""
    inner = _inner(tensor)
    return bool(inner) and all(t.is_floating_point() for _, t in inner)


def _inner(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A traceable wrapper subclass's inner tensors by name (none for another tensor)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return []
    names, _ = flatten()
    return [(n, getattr(tensor, n)) for n in names]


@dataclass
class ExtensionParam:
    """One extension parameter: its registrations and this rank's shard (see [Note: extension parameters])."""

    fqn: str
    registrations: list[tuple[nn.Module, str]]
    shape: tuple[int, ...]  # the full (unsharded) shape
    sharded_param: nn.Parameter  # this rank's rows, a frozen subclass parameter with storage of its own
    full: nn.Parameter | None = None  # the gathered subclass tensor, kept across gathers (see the note)
    buffers: list[torch.Tensor] = field(default_factory=list)  # 1D, world * shard numel: the all-gather outputs
    metadata: Any = None  # from the last fsdp_pre_all_gather, until the gather is rebuilt
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)  # of what fsdp_pre_all_gather returned
    trainable: bool = False  # sharded as a DTensor over the subclass shard, its gradient reduced (see the note)
    to_free: list[torch.Tensor] = field(default_factory=list)  # a trainable one's, from fsdp_post_all_gather
    unsynced: torch.Tensor | None = None  # full shape, reduce dtype: micro-batches' gradients with sync off

    @property
    def training(self) -> bool:
        """Trainable and not frozen since sharding: its full tensor requires grad and its gradient is reduced."""
        return self.trainable and self.sharded_param.requires_grad

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows, of the parameter's class (the local tensor of a trainable one's ``DTensor``)."""
        param = self.sharded_param
        return param._local_tensor if isinstance(param, DTensor) else param  # type: ignore[return-value]

    def register(self, tensor: torch.Tensor) -> None:
        for module, name in self.registrations:
            module._parameters[name] = tensor  # type: ignore[assignment]


class ExtensionParams:
    """The extension parameters of one unit: sharded at construction, gathered and freed with the unit's group."""

    def __init__(
        self, label: str, entries: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]], shard_group: ShardGroup
    ) -> None:
        self.label = label
        self.shard_group = shard_group
        self.world = shard_group.shard_size
        self.device = shard_group.device
        self.params = [
            ExtensionParam(fqn, regs, tuple(p.shape), self._shard(fqn, p), trainable=p.requires_grad)
            for fqn, regs, p in entries
        ]
        self._mesh: DeviceMesh | None = None
        self.param_dtype: torch.dtype | None = None  # the unit's compute dtype (MixedPrecisionPolicy.param_dtype)
        self.reduce_dtype: torch.dtype | None = None  # its reduce dtype (reduce_dtype, else param_dtype)
        self._works: list[Any] | None = None  # the gathers in flight
        self.gathered = False  # the full tensors are registered and current
        for ep in self.params:
            set_owner(ep.sharded_param, label)
            ep.register(ep.sharded_param)

    def _shard(self, fqn: str, param: nn.Parameter) -> nn.Parameter:
        data = _data(param).detach()
        if self.world == 1 and param.requires_grad and self.shard_group.replicate_size > 1:
            raise ValueError(
                f"unit {self.label!r}: parameter {fqn!r} ({type(data).__name__}, trainable) would be replicated over "
                f"{self.shard_group.replicate_size} ranks with one rank per shard group, where fullshard does not "
                "all-reduce a tensor-subclass parameter's gradient (the replicas would drift apart). Shard it over "
                "two or more ranks (a mesh whose shard dimension is > 1), freeze it (param.requires_grad_(False)), "
                "or leave it unsharded (ignored_params=...)."
            )
        if self.world == 1:
            return nn.Parameter(data, requires_grad=param.requires_grad)
        rank = self.shard_group.shard_rank
        rows = param.shape[0] if param.dim() else 0
        problem = None
        if rows % self.world and not param.requires_grad:
            problem = f"its {rows} rows do not split evenly over {self.world} ranks"
        else:
            try:  # uneven (trainable only): torch.chunk's rows, none for the ranks past them (see _padded_rows)
                if rows % self.world == 0:
                    chunk = torch.chunk(data, self.world, dim=0)[rank]
                else:
                    padded = _padded_rows(rows, self.world)
                    chunk = data[min(rank * padded, rows) : min((rank + 1) * padded, rows)]
            except (AssertionError, NotImplementedError, RuntimeError) as err:
                problem = f"{type(data).__name__} could not split it by rows ({err})"
        if problem is not None:
            raise ValueError(
                f"unit {self.label!r}: parameter {fqn!r} ({type(data).__name__} of shape {tuple(param.shape)}) cannot "
                f"be sharded: {problem}. Quantize it with block sizes that divide a shard's elements (torchao's "
                "to_nf4(w, block_size, scaler_block_size): rows/world * cols divisible by block_size * "
                "scaler_block_size), or leave it unsharded (ignored_params=...)."
            )
        local = _copy(chunk)  # storage of its own: the full tensor can be freed
        if not param.requires_grad:
            return nn.Parameter(local, requires_grad=False)
        return nn.Parameter(self.shard_group.dtensor(local, tuple(param.shape)), requires_grad=True)

    # --- gather / free ------------------------------------------------------------------------------

    def _shard_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.shard_group.shard_pg, self.device.type)
        return self._mesh

    def _pre_all_gather(self, ep: ExtensionParam) -> tuple[tuple[torch.Tensor, ...], Any]:
        inputs, metadata = self._call_pre_all_gather(ep)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        # uneven rows: an input of this rank's rows is padded to a full shard's rows, so every rank sends as many
        padded, local_rows = _padded_rows(ep.shape[0], self.world), ep.local.shape[0]
        if ep.trainable and ep.shape and local_rows != padded:
            inputs = tuple(_pad_rows(t, padded) if t.dim() and t.shape[0] == local_rows else t for t in inputs)
        return tuple(inputs), metadata

    def _call_pre_all_gather(self, ep: ExtensionParam) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = ep.local
        if local.device != self.device:
            local = local.to(self.device)
        hook = getattr(local, "fsdp_pre_all_gather", None)
        if hook is None or not callable(getattr(local, "fsdp_post_all_gather", None)):
            raise ValueError(
                f"unit {self.label!r}: parameter {ep.fqn!r} (a {type(local).__name__}) has no fsdp_pre_all_gather/"
                "fsdp_post_all_gather at its gather: fullshard gathers a tensor-subclass parameter through torch "
                "FSDP2's all-gather protocol only. Define both on its class, or set them on its local shard "
                "(param.to_local() or param._local_tensor) before the first forward."
            )
        if len(inspect.signature(hook).parameters) == 1:
            return hook(self._shard_mesh())
        stride = torch.empty(ep.shape, device="meta").stride()
        module = ep.registrations[0][0]
        return hook(self._shard_mesh(), torch.Size(ep.shape), stride, module, None)

    def unshard(self) -> None:
        """Start gathering every extension parameter (no-op if gathered or gathering, or with one rank)."""
        if self.world == 1 or self.gathered or self._works is not None:
            return
        pg = self.shard_group.shard_pg
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gathered buffer, this rank's input), in order
        with trace.phase(trace.ALL_GATHER):
            for ep in self.params:
                inputs, ep.metadata = self._pre_all_gather(ep)
                if not ep.buffers:
                    ep.buffers = [
                        torch.empty(self.world * t.numel(), dtype=t.dtype, device=self.device) for t in inputs
                    ]
                for buf, t in zip(ep.buffers, inputs):
                    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                    pairs.append((buf, _plain(t).view(-1)))
                ep.input_shapes = [tuple(t.shape) for t in inputs]

            def post(tag: int | None) -> list[Any]:
                return [all_gather_flat(buf, mine, pg, async_op=True, tag=tag) for buf, mine in pairs]

            self._works = collective_check.issue("all_gather", self.label, pg, post)

    def wait(self) -> None:
        """Finish the gathers started by :meth:`unshard` and register the full tensors (again, after
        :meth:`register_sharded`)."""
        if self.world == 1:
            return
        if self._works is None and not self.gathered:
            return  # nothing gathered or in flight (a group resharding while its own gather was in flight)
        if self._works is not None:
            with trace.phase(trace.ALL_GATHER_WAIT):
                for work in self._works:
                    if work is not None:
                        work.wait()
            self._works = None
            for ep in self.params:
                self._rebuild(ep)
            self.gathered = True
        for ep in self.params:
            ep.register(ep.full)  # type: ignore[arg-type]

    def _rebuild(self, ep: ExtensionParam) -> None:
        outputs = tuple(buf.view(-1, *shape[1:]) for buf, shape in zip(ep.buffers, ep.input_shapes))
        post = ep.local.fsdp_post_all_gather  # type: ignore[attr-defined]
        # a trainable one is gathered in the compute dtype, as torch's fully_shard does (frozen ones as they are)
        dtype = (self.param_dtype if ep.trainable else None) or ep.sharded_param.dtype
        if ep.full is None:
            full, to_free = post(outputs, ep.metadata, dtype)
            if ep.trainable:  # what the hook says may be freed, freed at reshard as torch does (see reshard)
                ep.to_free = [t for t in to_free if type(t) is torch.Tensor]
            full = _cut(full, ep.shape)
            ep.full = nn.Parameter(full, requires_grad=ep.trainable)
        else:
            for t in ep.to_free:  # storage back for the hook's out= form (buffers' views already have it)
                nbytes = (t.storage_offset() + t.numel()) * t.element_size()
                if t.untyped_storage().nbytes() < nbytes:
                    t.untyped_storage().resize_(nbytes)
            post(outputs, ep.metadata, dtype, out=ep.full)
        if ep.full.requires_grad != ep.training:  # type: ignore[union-attr]  # frozen or unfrozen since sharding
            ep.full.requires_grad_(ep.training)  # type: ignore[union-attr]
        ep.metadata = None

    def register_sharded(self) -> None:
        for ep in self.params:
            ep.register(ep.sharded_param)

    def reshard(self) -> None:
        """Register the shards again and free the gathered buffers (the full tensor objects stay, storage-less)."""
        if self.world == 1:
            return
        if self._works is not None:
            self.wait()
        self.register_sharded()
        for ep in self.params:
            for t in [*ep.buffers, *ep.to_free]:
                t.untyped_storage().resize_(0)
        self.gathered = False

    def training_params(self) -> list[ExtensionParam]:
        """The ones in training (:attr:`ExtensionParam.training`); drops the gradients of the trainable ones frozen
        since sharding, which are not reduced."""
        for ep in self.params:
            if ep.trainable and not ep.training and ep.full is not None:
                ep.full.grad = None
        return [ep for ep in self.params if ep.training]

    def hold_unsynced_grads(self) -> None:
        """With gradient sync off, move each trainable parameter's unsharded gradient into a sum kept in the reduce
        dtype when that is wider (float32 under bf16 compute), as a plain parameter's (``precision.widened_sum``);
        :meth:`reduce_grads` adds the synced backward's gradient to it and reduces it."""
        if self.world == 1 or self.reduce_dtype is None:
            return
        for ep in self.training_params():
            grad = ep.full.grad if ep.full is not None else None
            held = widened_sum(ep.unsynced, grad, self.reduce_dtype)
            if held is not None:
                ep.full.grad, ep.unsynced = None, held  # type: ignore[union-attr]

    def drop_grads(self) -> None:
        """Drop the unreduced gradients (``reset_iter_state`` after an aborted iteration)."""
        for ep in self.params:
            ep.unsynced = None
            if ep.full is not None:
                ep.full.grad = None

    def reduce_grads(self, options: CommOptions) -> None:
        """Reduce each trainable parameter's unsharded gradient (of this backward, or summed over the backwards
        since the last reduction) to its shard and add it to the sharded parameter's ``.grad`` (see the note); a
        collective over the shard group (and the replicas) whether or not a rank has a gradient for it. Reduced
        in the unit's ``reduce_dtype`` and divided as a plain parameter's (``options.divide_factor``); a parameter
        that got no gradient on any rank keeps ``.grad`` as it was (``None`` after ``zero_grad()``)."""
        eps = self.training_params()
        if self.world == 1 or not eps:
            return
        pg = self.shard_group.shard_pg
        for ep in eps:
            grad = ep.full.grad if ep.full is not None else None
            if ep.unsynced is not None:  # micro-batches' sum, with sync off (see hold_unsynced_grads)
                grad = ep.unsynced if grad is None else ep.unsynced.add_(grad)
                ep.unsynced = None
            dtype = self.reduce_dtype or ep.sharded_param.dtype
            padded = _padded_rows(ep.shape[0], self.world)
            flat = torch.zeros((self.world * padded, *ep.shape[1:]), dtype=dtype, device=self.device)
            if grad is not None:
                with torch.no_grad():
                    flat[: ep.shape[0]].copy_(grad)  # a wrapper subclass's gradient through its own copy_
                if ep.full is not None:
                    ep.full.grad = None
            before, after = gradient_divide_factors(self.shard_group.data_parallel_size, dtype, options.divide_factor)
            if before != 1:
                flat.div_(before)
            rows = torch.empty(padded * flat[0].numel(), dtype=dtype, device=self.device)
            with trace.phase(trace.REDUCE_SCATTER), collective_check.collective("reduce_scatter", self.label, pg):
                work = reduce_scatter_flat(rows, flat.view(-1), pg, async_op=True, scratch_input=True)
            pending = PendingReduce([work] if work is not None else [], rows, flat, after)
            output = finish_reduce(pending, self.shard_group, self.label)  # the replicas' all-reduce, the division
            if output is None:  # only with requires_all_reduce off, which options=None is not
                raise AssertionError(f"unit {self.label!r}: the reduction of {ep.fqn!r} was not finished")
            local = output.view(padded, *ep.shape[1:])[: ep.local.shape[0]].to(ep.sharded_param.dtype)
            accumulate_sharded_grad(ep.sharded_param, local, self.shard_group, unused=grad is None)

    def full_copies(self) -> list[torch.Tensor]:
        """Every extension parameter's full tensor in storage of its own, gathered into new buffers (a collective
        over the shard group; what the modules have registered does not change)."""
        if self.world == 1:
            return [_copy(ep.local) for ep in self.params]
        pg = self.shard_group.shard_pg
        copies = []
        with collective_check.collective("all_gather", self.label, pg):
            for ep in self.params:
                inputs, metadata = self._pre_all_gather(ep)
                outputs = []
                for t in inputs:
                    out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=self.device)
                    all_gather_flat(out, _plain(t).view(-1), pg, async_op=False)
                    outputs.append(out.view(-1, *t.shape[1:]))
                full, _ = ep.local.fsdp_post_all_gather(tuple(outputs), metadata, ep.sharded_param.dtype)  # type: ignore[attr-defined]
                copies.append(_cut(full, ep.shape))
        return copies

    def load(self, ep: ExtensionParam, value: Any, key: str) -> None:
        """Copy this rank's rows of ``value`` (the whole tensor, or a ``DTensor`` of this rank's shard, of the
        parameter's class) into its shard's inner tensors; the next gather sees them."""
        self.reshard()
        local = value.to_local() if isinstance(value, DTensor) else value
        shard = ep.local
        if type(local) is type(shard) and tuple(value.shape) == ep.shape and self.world > 1 and local is value:
            local = torch.chunk(local, self.world, dim=0)[self.shard_group.shard_rank]
        if type(local) is not type(shard) or tuple(local.shape) != tuple(shard.shape):
            got = f"{type(local).__name__} of shape {tuple(getattr(local, 'shape', ()))}"
            raise ValueError(
                f"load_state_dict: {key!r} is a {type(shard).__name__} of shape {ep.shape} sharded by its own "
                f"all-gather, but the state dict holds a {got}. Load a state dict saved from the same quantized model "
                "(FULL or SHARDED), or load the base model unquantized and quantize it after loading."
            )
        names, _ = shard.__tensor_flatten__()  # type: ignore[attr-defined]
        with torch.no_grad():
            for name in names:
                getattr(shard, name).copy_(getattr(local, name))


def _cut(full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``full`` gathered from padded shards cut back to the parameter's rows (a view), as torch's ``fully_shard``."""
    if tuple(full.shape) == shape:
        return full
    return torch.as_strided(full, shape, torch.empty(shape, device="meta").stride(), 0)


def _padded_rows(rows: int, world: int) -> int:
    """A shard's rows: ``ceil(rows / world)``, the last ranks' shards shorter or empty (as ``torch.chunk``)."""
    return -(-rows // world)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` (plain) with zero rows appended up to ``rows``."""
    out = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]].copy_(tensor)
    return out


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous, as a plain tensor (a subclass all-gather input is copied by its own ``copy_``)."""
    if type(tensor) is torch.Tensor:
        return tensor.contiguous()
    plain = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        plain.copy_(tensor)
    return plain


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A traceable wrapper subclass tensor with its inner tensors copied (``clone`` may re-quantize)."""
    names, ctx = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(tensor, n).clone() for n in names}
    try:
        copy = type(tensor).__tensor_unflatten__(inner, ctx, tensor.size(), tensor.stride())  # type: ignore[attr-defined]
    except TypeError:  # not the traceable signature
        copy = None
    if type(copy) is not type(tensor):  # an unflatten that does not rebuild its class: the subclass's own clone
        return tensor.clone()
    return copy
