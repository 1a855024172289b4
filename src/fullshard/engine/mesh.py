"""Which ranks a unit shards over and which it replicates over.

A :class:`ShardGroup` is the engine's view of the process topology for one unit:

- ``shard_pg``: the ranks that split parameters between them (``None`` when nothing is sharded, as in
  NO_SHARD: every rank then holds everything and ``shard_size == 1``);
- ``replicate_pg``: the ranks that hold identical shards and all-reduce gradients (``None`` for FULL_SHARD
  and SHARD_GRAD_OP over the whole world, and whenever it would have one rank);
- ``mesh``: the ``DeviceMesh`` the sharded parameters are ``DTensor``s over, for ``fully_shard`` and for
  sharded state dicts (dims ``(shard,)`` or ``(replicate, shard)``). :meth:`ShardGroup.placements` and
  :meth:`ShardGroup.dtensor` are the one place a sharded tensor's ``DTensor`` form is decided.

A parameter that is already a ``DTensor`` on another mesh dimension (tensor parallel, from torch's
``parallelize_module``) carries a :class:`TPSpec` (built by :meth:`ShardGroup.tp_spec`); see
[Note: tensor parallel parameters] below. With ``tp_mesh`` set (``fully_shard(..., tp_mesh=...)``, which
Accelerate's ``ParallelismConfig`` uses), the unit's plain parameters are replicated over that tp dimension: their
sharded form is a ``DTensor`` over (dp dims..., tp) with ``Replicate()`` on tp, while modules still compute with
plain tensors (:meth:`ShardGroup.replicated_tp_spec`).

Gradients are averaged over ``data_parallel_size = shard_size * replicate_size`` ranks.
"""

from __future__ import annotations

import copy
import functools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.engine.api import ShardingStrategy

__all__ = [
    "ShardGroup",
    "TPSpec",
    "build_shard_group",
    "is_gloo",
    "require_process_group",
    "shard_group_from_mesh",
    "simulating",
]

_IS_GLOO: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()


def is_gloo(pg: dist.ProcessGroup | None) -> bool:
    """``pg`` is a gloo group (cached: asked on the hot path, once per collective or post-backward)."""
    if pg is None:
        return False
    if pg not in _IS_GLOO:
        _IS_GLOO[pg] = dist.get_backend(pg) == "gloo"
    return _IS_GLOO[pg]


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class ShardGroup:
    """The process groups one unit communicates over; see the module docstring."""

    shard_pg: dist.ProcessGroup | None
    replicate_pg: dist.ProcessGroup | None
    device: torch.device
    mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None
    """The tensor parallel dimension plain parameters are replicated over (``None``: they stay dp-only)."""

    def __post_init__(self) -> None:
        if self.replicate_pg is not None and dist.get_world_size(self.replicate_pg) == 1:
            object.__setattr__(self, "replicate_pg", None)  # one replica: nothing to all-reduce across

    # The sizes and ranks are asked on the hot path (every gather and reduction) and never change for a group.
    @functools.cached_property
    def shard_size(self) -> int:
        return 1 if self.shard_pg is None else dist.get_world_size(self.shard_pg)

    @functools.cached_property
    def shard_rank(self) -> int:
        return 0 if self.shard_pg is None else dist.get_rank(self.shard_pg)

    @functools.cached_property
    def reduce_pg(self) -> dist.ProcessGroup | None:
        """The group a unit's gradients are reduced over first: its shard group, or with one rank per shard
        group the replicas (HSDP's all-reduce)."""
        return self.shard_pg if self.shard_size > 1 else self.replicate_pg

    @functools.cached_property
    def replicate_size(self) -> int:
        return 1 if self.replicate_pg is None else dist.get_world_size(self.replicate_pg)

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    def get_mesh(self) -> DeviceMesh:
        """The mesh sharded parameters live on (built on first use for FullyShardedDataParallel)."""
        if self.mesh is not None:
            return self.mesh
        mesh = _mesh_for(self)
        object.__setattr__(self, "mesh", mesh)
        return mesh

    def placements(self) -> tuple[Placement, ...]:
        """How sharded tensors lie on :meth:`get_mesh`: ``Shard(0)`` on a 1-D mesh, ``(Replicate(), Shard(0))``
        on a 2-D (replicate, shard) one, ``Replicate()`` when nothing is sharded (NO_SHARD)."""
        if self.get_mesh().ndim == 2:
            return (Replicate(), Shard(0))
        if self.shard_pg is None:
            return (Replicate(),)
        return (Shard(0),)

    def dtensor(
        self,
        local: torch.Tensor,
        shape: tuple[int, ...],
        tp: TPSpec | None = None,
        placements: tuple[Placement, ...] | None = None,
    ) -> DTensor:
        """``local`` (this rank's part, no copy) as a contiguous ``DTensor`` of global ``shape``; over
        ``tp.spmd_mesh`` for a tensor parallel parameter."""
        if tp is not None:
            return DTensor.from_local(
                local, tp.spmd_mesh, tp.spmd_placements, run_check=False, shape=torch.Size(tp.shape), stride=tp.stride
            )
        stride = torch.empty(shape, device="meta").stride()  # contiguous strides; allocates nothing
        placements = placements if placements is not None else self.placements()
        mesh = self.get_mesh()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    @staticmethod
    def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
        """``local`` (this rank's part, contiguous) as a ``DTensor`` laid out as ``like`` (its mesh, placements,
        global shape and stride; ``local``'s dtype), for tensors built at every step: sharded gradients.

        Built directly, as torch FSDP2 builds its sharded gradients: no autograd function and no checks (what
        ``DTensor.from_local`` costs), and the spec object is ``like``'s where the dtypes agree, so its hash, which
        ``DTensor``'s dispatch caches sharding decisions on, is computed once rather than once per step.
        """
        spec = like._spec
        if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
            spec = copy.copy(spec)  # its setattr forgets the copied hash
            spec.tensor_meta = TensorMeta(like.shape, like.stride(), local.dtype)
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]

    def tp_spec(self, param: DTensor, fqn: str) -> TPSpec:
        """The :class:`TPSpec` of ``param``, a ``DTensor`` over a mesh dimension other than this group's."""
        dp_mesh, tp_mesh = self.get_mesh(), param.device_mesh
        if tp_mesh.ndim != 1:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor over a {tp_mesh.ndim}-D mesh; fully_shard combines with one "
                "tensor parallel mesh dimension (parallelize_module(module, mesh['tp'], ...))."
            )
        spmd_mesh = _spmd_mesh(dp_mesh, tp_mesh, fqn)
        # Dim 0 already split by tensor parallelism: the dp shards split each tp shard, which DTensor calls
        # _StridedShard (so that full_tensor() puts the rows back in order).
        split = param._spec.num_shards_map[0]
        dp = tuple(
            _StridedShard(0, split_factor=split) if isinstance(pl, Shard) and split > 1 else pl
            for pl in self.placements()
        )
        return TPSpec(
            mesh=tp_mesh,
            placements=tuple(param.placements),
            shape=tuple(param.shape),
            stride=tuple(param.stride()),
            spmd_mesh=spmd_mesh,
            spmd_placements=(*dp, *param.placements),
        )

    def replicated_tp_spec(self, param: torch.Tensor, fqn: str) -> TPSpec:
        """The :class:`TPSpec` of a plain parameter replicated over :attr:`tp_mesh`: sharded over dp like any
        parameter, a ``DTensor`` placed ``Replicate()`` on tp, computed with as a plain tensor."""
        if self.tp_mesh is None:
            raise AssertionError(f"[rank {dist.get_rank()}] {fqn}: replicated_tp_spec on a shard group without tp_mesh")
        shape = tuple(param.shape)
        return TPSpec(
            mesh=self.tp_mesh,
            placements=(Replicate(),),
            shape=shape,
            stride=tuple(torch.empty(shape, device="meta").stride()),
            spmd_mesh=_spmd_mesh(self.get_mesh(), self.tp_mesh, fqn),
            spmd_placements=(*self.placements(), Replicate()),
            plain_compute=True,
        )


@dataclass(frozen=True)
class TPSpec:
    """How a tensor parallel parameter lies, before and after sharding.

    [Note: tensor parallel parameters]
    ``parallelize_module(block, mesh["tp"], ...)`` leaves ``DTensor`` parameters over the tp mesh; then
    ``fully_shard(block, mesh=mesh["dp"])`` shards each one's *local tensor* on dim 0 over dp, exactly as it
    shards a plain parameter (the dim-0 layout, the flat buffers and every collective see only plain local
    tensors, and reduce over dp only). Two views of that local tensor are ``DTensor``s again:

    - the sharded parameter (what the optimizer steps on, and what state dicts hold): over ``spmd_mesh``,
      the dp mesh dims followed by the tp dim, with ``spmd_placements``: the unit's usual placements
      (``Shard(0)``, or ``(Replicate(), Shard(0))`` for HSDP) where ``Shard(0)`` becomes
      ``_StridedShard(0, split_factor=tp shards)`` when tensor parallelism also splits dim 0 (dp splits each
      tp shard, so ``full_tensor()`` needs the stride), then the tp placements; global ``shape``/``stride``.
    - during compute, modules see ``DTensor.from_local(view of flat_full, mesh, placements)`` (the tp mesh
      and placements the parameter came with), so forward runs tensor parallel as before, and its backward
      redistributes the gradient to those placements and hands the local gradient to ``flat_full``.
    """

    mesh: DeviceMesh  # the tp mesh (1-D)
    placements: tuple[Placement, ...]  # on mesh
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]  # global
    spmd_mesh: DeviceMesh  # (dp dims..., tp)
    spmd_placements: tuple[Placement, ...]
    plain_compute: bool = False
    """Modules compute with the plain local tensor (a plain parameter replicated over tp by ``tp_mesh``): every
    tp rank computes the same gradient, so nothing is redistributed over tp."""

    @property
    def num_shards(self) -> int:
        """Distinct pieces tensor parallelism splits the parameter into (1: replicated over tp)."""
        return self.mesh.size() if any(p.is_shard() for p in self.placements) else 1

    def compute_view(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's tp part, full over dp) as the ``DTensor`` modules compute with (``local``
        itself when :attr:`plain_compute`)."""
        if self.plain_compute:
            return local
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=self.stride
        )

    def full_of(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every tp rank's ``local`` (a collective over the tp mesh unless replicated)."""
        if all(p.is_replicate() for p in self.placements):
            return local
        return self.compute_view(local).full_tensor()

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tp part of the global tensor ``full`` (a view; no communication)."""
        shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        for dim, (size, start) in enumerate(zip(shape, offset)):
            full = full.narrow(dim, start, size)
        return full


_SPMD_MESHES: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh] = {}


def _spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The dp mesh's dims followed by the tp mesh's, built once per pair (both slices of one mesh)."""
    key = (dp_mesh, tp_mesh)
    if key not in _SPMD_MESHES:
        if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor over another mesh, so fully_shard(mesh=...) and its mesh must be "
                "named dimensions of one mesh: init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
                "then parallelize_module(module, mesh['tp'], ...) and fully_shard(module, mesh=mesh['dp'])."
            )
        try:
            _SPMD_MESHES[key] = DeviceMesh._concatenate([dp_mesh, tp_mesh])
        except RuntimeError as err:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor over mesh {tp_mesh.mesh_dim_names}, which is not another dimension "
                f"of the mesh fully_shard shards over ({dp_mesh.mesh_dim_names}): {err}. Slice both from one mesh: "
                "parallelize_module(module, mesh['tp'], ...) and fully_shard(module, mesh=mesh['dp'])."
            ) from err
    return _SPMD_MESHES[key]


def simulating() -> bool:
    """True when the default process group is torch's fake backend (nothing is sent, nothing is received).

    A planning run: a model built on ``meta`` is wrapped, sharded and stepped with every unit left on ``meta``
    (shards, gathered buffers and gradients have shapes and dtypes, no storage) while the engine issues its real
    collective schedule and records its bytes in ``COMM_STATS``. Only two engine decisions change
    (``resolve_device`` picks ``meta`` for an all-meta module, and the first forward does not refuse meta
    parameters); everything else runs as on real ranks. ``benchmarks/simulate.py`` drives it.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def require_process_group(where: str) -> None:
    """Raise a how-to-launch message when no default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where} needs an initialised process group, but torch.distributed has none. Launch one "
            "process per rank, e.g. `torchrun --nproc_per_node 2 train.py` or `fullshard launch "
            "--num_processes 2 train.py`, and call torch.distributed.init_process_group('gloo' on CPU, "
            "'nccl' on GPU) before wrapping the model."
        )


_GROUP_CACHE: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _hybrid_groups(pg: dist.ProcessGroup, shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Shard groups of ``shard_size`` consecutive ranks of ``pg`` and the matching replicate groups.

    Every rank creates every group, in the same order (``new_group`` is collective), once per layout.
    """
    ranks = dist.get_process_group_ranks(pg)
    key = (*ranks, -shard_size)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]
    me = dist.get_rank()
    shard_mine = replicate_mine = None
    for start in range(0, len(ranks), shard_size):
        group = dist.new_group(ranks[start : start + shard_size])
        if me in ranks[start : start + shard_size]:
            shard_mine = group
    for offset in range(shard_size):
        members = ranks[offset::shard_size]
        group = dist.new_group(members)
        if me in members:
            replicate_mine = group
    if shard_mine is None or replicate_mine is None:
        raise AssertionError(f"[rank {me}] not found among ranks {ranks} of the process group")
    _GROUP_CACHE[key] = (shard_mine, replicate_mine)
    return shard_mine, replicate_mine


def _auto_shard_size(world: int) -> int:
    """Ranks per node for HYBRID_SHARD without explicit groups: LOCAL_WORLD_SIZE as set by torchrun."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 0 and torch.cuda.is_available():
        local = torch.cuda.device_count()
    if local <= 0 or world % local != 0:
        raise ValueError(
            f"sharding_strategy=HYBRID_SHARD needs the ranks per node to build shard groups, but "
            f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r} does not divide the world size {world}. "
            "Launch with torchrun (which sets it), or pass process_group=(shard_group, replicate_group) "
            "or a 2-D device_mesh of shape (replicate, shard)."
        )
    return local


def build_shard_group(
    strategy: ShardingStrategy,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
    device: torch.device,
) -> ShardGroup:
    """Resolve FullyShardedDataParallel's ``process_group`` / ``device_mesh`` for ``strategy``."""
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("FullyShardedDataParallel got both process_group and device_mesh; pass only one of them.")
        return shard_group_from_mesh(device_mesh, device, hybrid=strategy in HYBRID_STRATEGIES)
    if strategy in HYBRID_STRATEGIES:
        if isinstance(process_group, tuple):
            if len(process_group) != 2:
                raise ValueError(
                    f"process_group for {strategy.name} must be a (shard_group, replicate_group) pair, "
                    f"got a tuple of {len(process_group)}."
                )
            shard_pg, replicate_pg = process_group
        else:
            pg = process_group or dist.group.WORLD
            shard_pg, replicate_pg = _hybrid_groups(pg, _auto_shard_size(dist.get_world_size(pg)))
        return ShardGroup(shard_pg, replicate_pg, device)
    if isinstance(process_group, tuple):
        raise ValueError(
            f"process_group is a tuple, which only HYBRID_SHARD and _HYBRID_SHARD_ZERO2 take; got "
            f"sharding_strategy={strategy.name}. Pass a single process group."
        )
    pg = process_group or dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return ShardGroup(None, pg, device)
    return ShardGroup(pg, None, device)


def shard_group_from_mesh(mesh: DeviceMesh, device: torch.device, *, hybrid: bool | None = None) -> ShardGroup:
    """A 1-D mesh shards over all its ranks; a 2-D mesh is ``(replicate, shard)``."""
    if mesh.ndim == 1:
        if hybrid:
            raise ValueError(
                "a hybrid sharding strategy needs a 2-D device_mesh of shape (replicate, shard); got a 1-D "
                f"mesh of size {mesh.size()}. Build one with init_device_mesh(device, (replicas, shards))."
            )
        return ShardGroup(mesh.get_group(0), None, device, mesh)
    if mesh.ndim == 2:
        return ShardGroup(mesh.get_group(1), mesh.get_group(0), device, mesh)
    # The opening words are torch fully_shard's, which users' code matches on.
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: it has {mesh.ndim} dimensions. Pass a 1-D mesh "
        "(shard) or a 2-D one (replicate, shard), e.g. a slice of a larger mesh: mesh['dp'] or mesh['dp_replicate', "
        "'dp_shard']."
    )


def _mesh_for(group: ShardGroup) -> DeviceMesh:
    device_type = group.device.type
    if group.shard_pg is None:
        pg = group.replicate_pg
        if pg is None:
            return DeviceMesh(device_type, torch.arange(1) + dist.get_rank(), _init_backend=False)
        return DeviceMesh.from_group(pg, device_type)
    if group.replicate_pg is None:
        return DeviceMesh.from_group(group.shard_pg, device_type)
    shard_ranks = dist.get_process_group_ranks(group.shard_pg)
    replicate_ranks = dist.get_process_group_ranks(group.replicate_pg)
    me = dist.get_rank()
    # Rows are replicas, columns are positions within a shard group (same layout in every replica).
    grid = torch.tensor([[r - me + s for s in shard_ranks] for r in replicate_ranks], dtype=torch.int)
    return DeviceMesh.from_group([group.replicate_pg, group.shard_pg], device_type, mesh=grid)
