"""Accelerate's ``ParallelismConfig``: the (dp_replicate, dp_shard, tp) mesh an ``Accelerator`` trains on.

``Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=R, dp_shard_size=S, tp_size=T))`` (or, with
no argument, ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` and the ``PARALLELISM_CONFIG_*`` variables that
``fullshard launch`` writes from a config file's ``parallelism_config`` section; see ``env.PARALLELISM_VARS``)
builds one device mesh with Accelerate's dimension names and order (``dp_replicate``, ``dp_shard``, ``tp``, the
sizes-1 ones left out) plus its flattened ``dp`` / ``dp_shard_cp`` / ``dp_cp`` dimensions, and exposes it as
``accelerator.torch_device_mesh``. Then, as Accelerate 1.15 does with FSDP2:

- a model must arrive tensor parallel over ``mesh["tp"]`` (``parallelize_module``, or transformers'
  ``from_pretrained(..., tp_plan="auto", device_mesh=mesh["tp"])``) with the configured ``tp_size``; a model of
  another tensor parallel size is refused (:func:`check_model_tp`);
- ``prepare`` shards it with ``fully_shard`` over ``mesh[fsdp_dim_names]`` (``dp_shard_cp``, with ``dp_replicate``
  first for HSDP), and replicates the parameters the tensor parallel plan left plain over ``tp``
  (``fully_shard(..., tp_mesh=mesh["tp"])``; see [Note: tensor parallel parameters] in ``engine/mesh.py``);
- data loaders deal batches by data parallel rank: the ranks of one tp group get the same batch
  (:func:`data_parallel_position`).

Context parallelism (``cp_size``) and DeepSpeed sequence parallelism (``sp_size``) are not implemented:
a size above 1 is refused by name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed import device_mesh as _torch_mesh
from torch.distributed.device_mesh import DeviceMesh

from fullshard.frontend import env

__all__ = [
    "ParallelismConfig",
    "TorchTensorParallelConfig",
    "check_model_tp",
    "data_parallel_position",
    "model_tp_size",
    "resolve_parallelism_config",
]

_MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's ``tp_handler``: torch tensor parallelism's options (``enable_async_tp`` is not supported,
    as in Accelerate, and only warns)."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn("TorchTensorParallelConfig(enable_async_tp=True): async tensor parallelism is not "
                          "supported; it is ignored.", stacklevel=3)  # fmt: skip


@dataclass
class ParallelismConfig:
    """The parallel dimensions to train on; sizes left ``None`` come from ``PARALLELISM_CONFIG_*`` (else 1).

    ``dp_replicate_size > 1`` with ``dp_shard_size > 1`` is HSDP; ``tp_size > 1`` needs a tensor parallel model.
    ``cp_size`` and ``sp_size`` must be 1 (fullshard has neither context nor sequence parallelism).
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: Any = None
    sp_handler: Any = None

    device_mesh = None  # built by get_device_mesh (class-level, as Accelerate's: not a constructor argument)

    def __post_init__(self) -> None:
        from_env = env.read_parallelism_env()
        for name, default in (("dp_replicate_size", 1), ("dp_shard_size", 1), ("tp_size", 1), ("cp_size", 1),
                              ("cp_backend", "torch"), ("sp_size", 1), ("sp_backend", "deepspeed")):  # fmt: skip
            if getattr(self, name) is None:
                setattr(self, name, from_env.get(name, default))
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}): must be an integer of at least 1.")
        for name, what in (("cp_size", "context parallelism"), ("sp_size", "sequence parallelism")):
            if getattr(self, name) > 1:
                raise NotImplementedError(
                    f"ParallelismConfig({name}={getattr(self, name)}): fullshard has no {what}. Leave {name}=1 "
                    "and use dp_replicate_size, dp_shard_size and tp_size."
                )
        if self.cp_backend != "torch":
            raise ValueError(f"ParallelismConfig(cp_backend={self.cp_backend!r}): the only backend is 'torch'.")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"ParallelismConfig(sp_backend={self.sp_backend!r}): the only backend is 'deepspeed'.")
        if self.tp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1, "
                f"tp_size={self.tp_size}): tensor parallelism combines with sharding (dp_shard_size > 1), not with "
                "replication alone. Set dp_shard_size > 1 (FSDP + TP, or with dp_replicate_size > 1 HSDP + TP)."
            )
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}_size={self._size(d)}" for d in ("dp_replicate", "dp_shard", "tp", "cp", "sp"))
        return f"ParallelismConfig({sizes}, total_size={self.total_size})"

    def to_json(self) -> dict[str, Any]:
        """The settings as plain values (the mesh left out)."""
        items = vars(self).items()
        return {k: (dict(vars(v)) if hasattr(v, "__dict__") else v) for k, v in items if k != "device_mesh"}

    # --- sizes and dimension names (Accelerate's properties) -----------------------------------------

    def _size(self, dim: str) -> int:
        return int(getattr(self, f"{dim}_size"))

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)
    total_size = property(lambda self: self.data_parallel_size * self.non_data_parallel_size)
    data_parallel_size = property(lambda self: self.dp_replicate_size * self.dp_shard_size)
    non_data_parallel_size = property(lambda self: self.tp_size * self.cp_size * self.sp_size)

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data parallel dimensions (each gets its own batches)."""
        return [d for d in ("dp_replicate", "dp_shard") if self._size(d) > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks get the same batch."""
        return [d for d in ("tp", "cp", "sp") if self._size(d) > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return [d for d in ("dp_shard", "cp") if self._size(d) > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return [d for d in ("dp_replicate", "dp_shard", "cp") if self._size(d) > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions the model is sharded over (``dp_replicate`` first for HSDP)."""
        return [*(["dp_replicate"] if self.dp_replicate_enabled else []), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def _set_size(self, dim: str, size: int) -> None:
        if dim not in _MESH_ORDER:
            raise ValueError(f"ParallelismConfig: no dimension {dim!r}; the dimensions are {', '.join(_MESH_ORDER)}.")
        setattr(self, f"{dim}_size", size)

    # --- the mesh ------------------------------------------------------------------------------------

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        """(dimension names, sizes) of the enabled dimensions in Accelerate's order; ``()`` when none is."""
        dims = sorted(self.active_mesh_dims, key=_MESH_ORDER.index)
        return (tuple(dims), tuple(self._size(d) for d in dims)) if dims else ()

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """The mesh of the enabled dimensions, with the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp``
        dimensions; ``None`` when every size is 1."""
        layout = self._get_mesh()
        if not layout:
            return None
        names, shape = layout
        # Looked up on torch's module at each call, as Accelerate does, so a test that patches
        # torch.distributed.device_mesh.init_device_mesh sees the mesh fullshard asks for.
        mesh = _torch_mesh.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):  # fmt: skip
            if dims:
                mesh[dims]._flatten(flat)  # the list, as Accelerate indexes it
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh | None:
        """The mesh, built on first use for ``device_type``."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("ParallelismConfig.get_device_mesh(): pass device_type (e.g. 'cuda' or 'cpu') the "
                                 "first time, to build the mesh.")  # fmt: skip
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"ParallelismConfig.get_device_mesh(device_type={device_type!r}): the mesh was built for "
                f"{self.device_mesh.device_type!r}. Use one device type per process."
            )
        return self.device_mesh

    def _validate_accelerator(self, accelerator: Any) -> None:
        """Check the config against the accelerator's processes and plugin, before the mesh is built."""
        world = accelerator.num_processes
        if world == 1 and self.total_size == 1:
            return
        if self.total_size == 1:  # nothing set: every rank a replica (which FSDP cannot shard; refused below)
            self._set_size("dp_replicate", world)
        if self.total_size != world:
            raise ValueError(
                f"{self!r}: total_size {self.total_size} (dp_replicate x dp_shard x tp) differs from the "
                f"{world} processes. Make the sizes multiply to the number of processes."
            )
        if not self.dp_shard_enabled:
            raise ValueError(
                f"{self!r}: dp_shard_size is 1, so the model has no dimension to be sharded over, and fullshard "
                "always shards it (as Accelerate's FSDP2 does). Give dp_shard_size > 1 (lower tp_size or "
                "dp_replicate_size), or train without a ParallelismConfig."
            )
        if accelerator.fsdp_plugin.fsdp_version != 2:
            raise ValueError(
                f"{self!r} with fsdp_version=1: a ParallelismConfig shards with fully_shard (FSDP version 2), as in "
                "Accelerate. Pass FullyShardedDataParallelPlugin(fsdp_version=2) or set fsdp_version: 2 in the "
                "config file's fsdp_config."
            )


def resolve_parallelism_config(given: object) -> ParallelismConfig | None:
    """``Accelerator(parallelism_config=...)``: the given config, else one built from the environment when
    ``ACCELERATE_USE_PARALLELISM_CONFIG`` is true (``fullshard launch`` with a ``parallelism_config`` section)."""
    if given is None:
        return ParallelismConfig() if env.read_parallelism_env().get("use_parallelism_config") else None
    if not isinstance(given, ParallelismConfig):
        raise TypeError(
            f"Accelerator(parallelism_config={type(given).__name__}): expected a ParallelismConfig "
            "(from fullshard import ParallelismConfig), or None."
        )
    return given


def model_tp_size(model: nn.Module) -> int | None:
    """The tensor parallel size ``model`` was split with: transformers' record (``model.tp_size``, or its
    config's ``distributed_config.tp_size``), else the size of the mesh its ``DTensor`` parameters lie on;
    ``None`` for a model that is not tensor parallel."""
    size = getattr(model, "tp_size", None)
    if size is None:
        distributed = getattr(getattr(model, "config", None), "distributed_config", None)
        size = distributed.get("tp_size") if isinstance(distributed, dict) else getattr(distributed, "tp_size", None)
    if size is not None:
        return int(size)
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    return max((m.size() for m in meshes), default=None)


def check_model_tp(model: nn.Module, config: ParallelismConfig) -> None:
    """Refuse a model whose tensor parallel size is not ``config.tp_size`` (as Accelerate does)."""
    size = model_tp_size(model)
    if config.tp_enabled and size is None:
        raise NotImplementedError(
            f"Accelerator.prepare({type(model).__name__}) with tp_size={config.tp_size}: the model is not tensor "
            "parallel. Make it so before prepare: parallelize_module(model, accelerator.torch_device_mesh['tp'], "
            "plan), or from_pretrained(..., tp_plan='auto') on that mesh."
        )
    if (size or 1) != config.tp_size:
        raise ValueError(
            f"Accelerator.prepare({type(model).__name__}): the ParallelismConfig's tp_size is {config.tp_size} but "
            f"the model is tensor parallel over {size or 1} ranks. Make them equal."
        )


def data_parallel_position(config: ParallelismConfig | None, process_index: int, num_processes: int) -> tuple[int, int]:
    """(this rank's batch index, number of distinct batches): the ranks of one tp group (consecutive, tp being
    the innermost mesh dimension) share a batch."""
    if config is None or config.device_mesh is None:
        return process_index, num_processes
    return process_index // config.non_data_parallel_size, config.data_parallel_size
