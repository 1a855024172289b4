"""Accelerate's process-wide singletons, ``PartialState`` and ``AcceleratorState``, over fullshard's runtime.

Libraries written for Accelerate (transformers' ``TrainingArguments`` and ``Trainer`` among them) build
``PartialState(cpu=..., backend=..., timeout=...)`` before any ``Accelerator`` exists, read ``device``,
``num_processes``, ``distributed_type`` from it, and later ask ``AcceleratorState()`` for the plugin of the
``Accelerator`` they built. Both classes keep one shared dictionary per class (Accelerate's "Borg" pattern): every
instance sees the same state, and ``_reset_state`` forgets it.

- ``PartialState`` initialises (or adopts) the process group through :func:`runtime.init_process_state`.
  ``distributed_type`` is Accelerate's for a process group without a plugin: ``NO`` for one process,
  ``MULTI_GPU`` / ``MULTI_CPU`` for several.
- ``AcceleratorState`` is filled by :meth:`AcceleratorState.register` when an ``Accelerator`` is built; it then
  says ``FSDP`` and holds that accelerator's ``fsdp_plugin``, ``mixed_precision`` and ``parallelism_config``
  (with its ``device_mesh``), or says ``NO`` with no plugin for an accelerator that does not shard. DeepSpeed
  and Megatron-LM plugins are always ``None``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

from fullshard.frontend.enums import DistributedType
from fullshard.frontend.processes import runtime
from fullshard.frontend.processes import work_split as processes

__all__ = ["AcceleratorState", "PartialState"]


class PartialState(runtime.ProcessView):
    """This process's rank, world and device, shared by every instance; see the module docstring."""

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        unknown = set(kwargs) - {"backend", "timeout", "init_method", "_use_sagemaker_dp"}
        if unknown or kwargs.get("_use_sagemaker_dp"):
            raise TypeError(
                f"PartialState({sorted(unknown or ['_use_sagemaker_dp'])[0]}=...): fullshard's PartialState takes "
                "cpu, backend, timeout and init_method (a process group for sharded training; no SageMaker)."
            )
        timeout: timedelta | None = kwargs.get("timeout")
        self._process = runtime.init_process_state(
            cpu=cpu, timeout=timeout, backend=kwargs.get("backend"), init_method=kwargs.get("init_method")
        )
        self._cpu = cpu

    @property
    def initialized(self) -> bool:
        return "_process" in self._shared_state

    @staticmethod
    def _reset_state() -> None:
        """Forget the shared state (the process group stays; the next instance adopts it)."""
        PartialState._shared_state.clear()

    @staticmethod
    def _adopt(process: runtime.ProcessState, cpu: bool) -> None:
        """An ``Accelerator`` was built: its process state is the shared one, unless one exists already."""
        PartialState._shared_state.setdefault("_process", process)
        PartialState._shared_state.setdefault("_cpu", cpu)

    backend: str = property(lambda self: self._process.backend)  # type: ignore[assignment]
    use_distributed: bool = property(lambda self: self.num_processes > 1)  # type: ignore[assignment]
    is_last_process: bool = property(lambda self: self.process_index == self.num_processes - 1)  # type: ignore[assignment]
    debug = False
    fork_launched = False

    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        return processes.split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return function if self.is_main_process else (lambda *a, **k: None)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return function if self.is_local_main_process else (lambda *a, **k: None)

    def destroy_process_group(self, group: Any = None) -> None:
        del group
        runtime.shutdown()

    def __getattr__(self, name: str) -> Any:  # only for names not found otherwise
        raise _missing("PartialState", name, "_process" not in self._shared_state)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )


class AcceleratorState:
    """The state of the ``Accelerator`` built in this process (shared by every instance); see the module docstring.

    Before an ``Accelerator`` registers, it answers for its ``PartialState`` only (``fsdp_plugin`` is ``None``).
    """

    _shared_state: ClassVar[dict[str, Any]] = {}
    _owner: ClassVar[weakref.ref[Any] | None] = None  # the Accelerator that filled the state
    deepspeed_plugin = None
    deepspeed_plugins = None
    megatron_lm_plugin = None
    parallelism_config = None
    torch_tp_plugin = None
    dynamo_plugin = None

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if "_partial" not in self._shared_state:
            self._partial = PartialState(cpu, **{k: v for k, v in kwargs.items() if k in ("backend", "timeout")})

    @classmethod
    def register(
        cls,
        fsdp_plugin: Any,
        mixed_precision: str,
        dynamo_plugin: Any = None,
        parallelism_config: Any = None,
        *,
        distributed_type: DistributedType = DistributedType.FSDP,
        accelerator: Any = None,
    ) -> AcceleratorState:
        """Called by ``Accelerator.__init__``: this process's state is now that accelerator's (``fsdp_plugin`` is
        ``None`` and ``distributed_type`` ``NO`` for one that does not shard). ``accelerator`` (held weakly) takes
        the writes to ``distributed_type``."""
        state = cls()
        state.fsdp_plugin = fsdp_plugin
        state._distributed_type = distributed_type
        cls._owner = weakref.ref(accelerator) if accelerator is not None else None  # not in the dict: it pickles
        state.parallelism_config = parallelism_config
        state._mixed_precision = mixed_precision
        state.dynamo_plugin = dynamo_plugin
        return state

    @property
    def initialized(self) -> bool:
        return "fsdp_plugin" in self._shared_state

    @classmethod
    def require(cls, name: str) -> None:
        """Raise Accelerate's ``AttributeError`` for ``name`` when no Accelerator filled the state (it was reset)."""
        if "fsdp_plugin" not in cls._shared_state:
            raise _missing("AcceleratorState", name, True)

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        AcceleratorState._owner = None
        if reset_partial_state:
            PartialState._reset_state()

    fsdp_plugin: Any = None
    mixed_precision: str = property(lambda self: self.__dict__.get("_mixed_precision", "no"))  # type: ignore[assignment]

    @property
    def distributed_type(self) -> DistributedType:
        if not self.initialized:
            return self._partial.distributed_type
        return self.__dict__.get("_distributed_type", DistributedType.FSDP)

    @distributed_type.setter
    def distributed_type(self, value: Any) -> None:
        """Accelerate's tests write ``accelerator.state.distributed_type = DistributedType.FSDP``: the accelerator
        that filled the state takes it (``Accelerator.distributed_type``'s rules)."""
        owner = AcceleratorState._owner if self.initialized else None
        accelerator = owner() if owner is not None else None
        if accelerator is None:
            raise ValueError(
                f"AcceleratorState().distributed_type = {value!r}: no Accelerator filled this state, so nothing would "
                "change. Build the Accelerator first (its fsdp_plugin or the environment decide sharding)."
            )
        accelerator.distributed_type = value

    @property
    def is_fsdp2(self) -> bool:
        return self.fsdp_plugin is not None and self.fsdp_plugin.fsdp_version == 2

    @property
    def device_mesh(self) -> Any:
        """The ParallelismConfig's mesh (``None`` without one)."""
        config = self.__dict__.get("parallelism_config")
        return None if config is None else config.device_mesh

    torch_device_mesh = device_mesh

    def __getattr__(self, name: str) -> Any:  # rank, world, device, ...: the PartialState's
        partial = self._shared_state.get("_partial")
        if name.startswith("__") or name == "_partial" or partial is None:
            raise _missing("AcceleratorState", name, partial is None)
        try:
            return getattr(partial, name)
        except AttributeError:
            raise _missing("AcceleratorState", name, "_process" not in partial._shared_state) from None


def _missing(cls: str, name: str, was_reset: bool) -> AttributeError:
    """Accelerate's ``AttributeError`` for a shared-state class, word for word (scripts and Accelerate's own tests
    match on it): after ``_reset_state()``, the process fields name the reset and the fix."""
    if was_reset and not name.startswith("__") and name in _PROCESS_FIELDS:
        return AttributeError(
            f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was called and an "
            "`Accelerator` or `PartialState` was not reinitialized."
        )
    return AttributeError(f"'{cls}' object has no attribute '{name}'")


# What a reset state no longer answers (Accelerate's ``_known_attrs``, and the fields they are read from here).
_PROCESS_FIELDS = frozenset(
    {
        "_process",
        "_partial",
        "_cpu",
        "_mixed_precision",
        "backend",
        "device",
        "distributed_type",
        "local_process_index",
        "num_processes",
        "process_index",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "use_distributed",
        "fsdp_plugin",
    }
)
