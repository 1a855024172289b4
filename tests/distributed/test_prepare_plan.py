"""``Accelerator.prepare`` resolves the plugin once and the engine shards by that one plan.

Set up: a TinyGPT, a plugin with a name-based wrap policy, a regex of ignored modules and activation
checkpointing, for each ``fsdp_version``; the plugin's resolving methods and the policy walk are counted.
Check: the policy is bound once, the ignored modules found once, the model's tree walked by the policy once;
the plan the engine received is the one resolved, and its units are exactly the model's units afterwards.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.algorithms import plan as sharding_plan
from fullshard.engine import wrapper
from fullshard.engine.unit_state import unit_states_in
from fullshard.frontend import prepare
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, TinyGPT
from tests.distributed.test_accelerator import CFG, plugin


def prepare_counting(rank: int, world: int, version: int) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    plans: list[sharding_plan.ShardingPlan] = []
    saved: list[tuple[Any, str, Any]] = []

    def count(owner: Any, name: str, label: str, when: Any = lambda *a, **k: True) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[label] += bool(when(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for method in ("set_auto_wrap_policy", "resolve_ignored_modules", "fsdp_kwargs", "fully_shard_kwargs"):
        count(FullyShardedDataParallelPlugin, method, method)
    for module in (wrapper, sharding_plan):  # the policy walks the tree (plan_units with a policy)
        count(module, "plan_units", "policy walks", when=lambda root, policy, **kw: policy is not None)
    count(prepare, "apply_plan", "apply_plan", when=lambda model, received: plans.append(received) is None)
    try:
        accelerator = Accelerator(fsdp_plugin=plugin(version, ignored_modules=r"ln_f", activation_checkpointing=True))
        model = accelerator.prepare(TinyGPT(CFG))
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    (received,) = plans
    inner = model.module if version == 1 else model
    units = [s.module for s in unit_states_in(model)]
    planned = [u.module for u in received.units]
    below_root = [getattr(u, "_fsdp_wrapped_module", u) for u in units[1:]]  # a wrapper's module, or the module
    return {
        "calls": dict(calls),
        "planned blocks": len(planned) == CFG.n_layer and all(isinstance(m, Block) for m in planned),
        "units are the plan's": sorted(map(id, below_root)) == sorted(map(id, planned)),
        "root": units[0] is model,
        "ignored": [m is inner.ln_f for m in received.ignored_modules],
        "checkpointed": received.checkpointed == tuple(planned),
        "ln_f unsharded": [type(p).__name__ for p in inner.ln_f.parameters()] == ["Parameter"] * 2,
    }


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_prepare_resolves_the_plugin_once(pool2: WorkerPool, version: int) -> None:
    for got in pool2.run(prepare_counting, version):
        assert got.pop("calls") == {
            "set_auto_wrap_policy": 1,
            "resolve_ignored_modules": 1,
            "policy walks": 1,
            "apply_plan": 1,
        }
        assert got == {
            "planned blocks": True,
            "units are the plan's": True,
            "root": True,
            "ignored": [True],
            "checkpointed": True,
            "ln_f unsharded": True,
        }


def fsdp2_helper(rank: int, world: int) -> tuple[list[str], str]:
    from fullshard.frontend.prepare import fsdp2_prepare_model

    accelerator = Accelerator(fsdp_plugin=plugin(2, activation_checkpointing=True))
    model = fsdp2_prepare_model(accelerator, TinyGPT(CFG))
    kinds = [type(s.module).__name__ for s in unit_states_in(model)]
    checkpointed = [getattr(b, "_fullshard_checkpointed", False) for b in model.blocks]
    try:
        fsdp2_prepare_model(Accelerator(fsdp_plugin=plugin(1)), TinyGPT(CFG))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return [*kinds, str(any(checkpointed))], refused


def test_fsdp2_prepare_model_shards_blocks_then_root_without_checkpointing(pool2: WorkerPool) -> None:
    kinds, refused = pool2.run(fsdp2_helper)[0]
    assert kinds == ["FSDPTinyGPT"] + ["FSDPBlock"] * CFG.n_layer + ["False"]
    assert refused.startswith("fsdp2_prepare_model(accelerator=...) with fsdp_version=1:"), refused
