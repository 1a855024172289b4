"""One process without FSDP (Accelerate's ``DistributedType.NO``): whether the Accelerator shards what it prepares.

This module owns that one decision (:func:`wants_sharding`, taken when the Accelerator is built) and its switch
(``accelerator.distributed_type = ...`` before the first ``prepare``, in :class:`ShardingChoice`, which the
Accelerator mixes in), and registers the outcome in Accelerate's shared ``AcceleratorState``. Invariants:
``self._sharding`` is the only record of the choice; it changes only while no model is prepared, never to ``NO``
for several processes or a ParallelismConfig, and every change is registered again (``_register_state``). The class
reads, and does not set up, the Accelerator's ``fsdp_plugin``, ``mixed_precision``, ``dynamo_plugin``,
``parallelism_config``, ``_objects`` and process fields; ``prepare_model`` runs a model as it is when ``_sharding``
is false.
"""

from __future__ import annotations

from fullshard.frontend import env
from fullshard.frontend.enums import DistributedType
from fullshard.frontend.parallelism import ParallelismConfig
from fullshard.frontend.processes.shared_state import AcceleratorState

__all__ = ["ShardingChoice", "wants_sharding"]


def _fsdp_env() -> bool:
    """Whether the environment asks for FSDP: ``ACCELERATE_USE_FSDP`` true (``accelerate launch --use_fsdp``,
    ``fullshard launch --use_fsdp``), or, with it unset, any ``FSDP_*`` plugin variable set."""
    use_fsdp = env.read_launch_env().get("use_fsdp")
    return bool(use_fsdp) if use_fsdp is not None else bool(env.read_env())


def wants_sharding(plugin_given: bool, config: ParallelismConfig | None, num_processes: int) -> bool:
    """Whether prepared models are sharded; see [Note: one process without FSDP]."""
    return plugin_given or config is not None or num_processes > 1 or _fsdp_env()


# [Note: one process without FSDP]
# Accelerate runs one process without a launcher as ``DistributedType.NO``: ``prepare`` returns the model as it
# is (moved to the device, its forward under autocast for mixed precision), and code that keeps using the model
# it built (attribute writes, its own hooks) sees the prepared one. fullshard does the same for one process when
# nothing asks for FSDP: no ``fsdp_plugin``, no ``parallelism_config``, and no FSDP in the environment
# (:func:`_fsdp_env`). Any of those, or a second process, shards as before (fullshard never runs DDP: several
# processes without a plugin shard with the default one). Setting ``accelerator.state.distributed_type`` to
# ``FSDP`` before the first ``prepare`` turns sharding on, as in Accelerate's tests. Without sharding, a
# checkpoint of ``save_state`` is the same folder as with it (the plugin's ``state_dict_type`` picks DCP folders
# or full files; see ``saving/model_state.py``), so it loads into a sharded model, and back.


class ShardingChoice:
    """The Accelerator's ``distributed_type`` (``FSDP`` or ``NO``) and ``is_fsdp2``; see the module docstring."""

    def _register_state(self) -> None:
        """This accelerator's fields in Accelerate's shared ``AcceleratorState`` (its plugin only when sharding)."""
        self._state = AcceleratorState.register(
            self.fsdp_plugin if self._sharding else None,
            self.mixed_precision,
            self.dynamo_plugin,
            self.parallelism_config,
            distributed_type=DistributedType.FSDP if self._sharding else DistributedType.NO,
            accelerator=self,
        )

    @property
    def distributed_type(self) -> DistributedType:
        """``FSDP`` when prepared models are sharded, ``NO`` for one process without FSDP (see [Note: one process
        without FSDP])."""
        AcceleratorState.require("distributed_type")
        return DistributedType.FSDP if self._sharding else DistributedType.NO

    @distributed_type.setter
    def distributed_type(self, value: DistributedType | str) -> None:
        """Accelerate's tests and some scripts write ``accelerator.state.distributed_type = DistributedType.FSDP``.

        ``FSDP`` turns sharding on (with ``fsdp_plugin``) before the first ``prepare``; ``NO`` turns it off for
        one process without a ParallelismConfig, before the first ``prepare``. Other types, or a change after
        models were prepared, are refused, naming why."""
        name = getattr(value, "value", value)
        wanted = name == DistributedType.FSDP.value
        if name not in (DistributedType.FSDP.value, DistributedType.NO.value):
            raise ValueError(
                f"accelerator.distributed_type = {value!r}: fullshard shards (DistributedType.FSDP) or, for one "
                "process, runs the model as it is (DistributedType.NO); it has no other distributed type. Use the "
                "real Accelerate for another one."
            )
        if wanted == self._sharding:
            return
        if self._objects.models:
            raise ValueError(
                f"accelerator.distributed_type = {value!r} after {len(self._objects.models)} model(s) were prepared "
                f"as {self.distributed_type.value}: set it before the first prepare()."
            )
        if not wanted and (self.num_processes > 1 or self.parallelism_config is not None):
            raise ValueError(
                f"accelerator.distributed_type = {value!r} with {self.num_processes} processes"
                f"{' and a ParallelismConfig' if self.parallelism_config is not None else ''}: several processes "
                "always shard (fullshard has no DDP). Leave it as DistributedType.FSDP."
            )
        self._sharding = wanted
        self._register_state()

    @property
    def is_fsdp2(self) -> bool:
        return self._sharding and self.fsdp_plugin.fsdp_version == 2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2
