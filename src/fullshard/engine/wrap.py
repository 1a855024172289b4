"""Auto-wrap policies: which submodules become sharding units of their own.

A policy is any callable ``policy(module, recurse, nonwrapped_numel) -> bool`` (torch's protocol):
asked with ``recurse=True`` it says whether to look inside ``module``'s children; asked with
``recurse=False`` it says whether ``module`` itself becomes a unit, given ``nonwrapped_numel``, the number of
parameters of ``module`` not already claimed by units below it. The policy classes here are such callables;
:class:`CustomPolicy` may also return a dict of constructor overrides for the unit it selects.

:func:`plan_units` applies a policy to a module tree (post-order, as torch does) and returns the units to
create, innermost first. :func:`wrap` / :func:`enable_wrap` mark units by hand.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "plan_units",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

PolicyFn = Callable[[nn.Module, bool, int], Any]

FORCE_LEAF_MODULES: set[type[nn.Module]] = {nn.MultiheadAttention}
EXCLUDE_WRAP_MODULES: set[type[nn.Module]] = {nn.ModuleList, nn.ModuleDict}


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """Every submodule becomes a unit."""
    return True


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """A module becomes a unit once it holds at least ``min_num_params`` parameters not claimed below it.

    Use with ``functools.partial(size_based_auto_wrap_policy, min_num_params=N)``.
    """
    leaves = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    excluded = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, excluded)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type[nn.Module]]
) -> bool:
    """Every instance of one of ``transformer_layer_cls`` becomes a unit.

    Use with ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
    """
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """``lambda_fn(module)`` says whether ``module`` becomes a unit."""
    if recurse:
        return True
    return bool(lambda_fn(module))


class ModuleWrapPolicy:
    """Every instance of one of ``module_classes`` becomes a unit."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = tuple(dict.fromkeys(module_classes))
        for cls in self._module_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"ModuleWrapPolicy(module_classes=...) got {cls!r}, which is not an nn.Module subclass; "
                    "pass the classes themselves, e.g. ModuleWrapPolicy({TransformerBlock})."
                )

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({{{', '.join(c.__name__ for c in self._module_classes)}}})"


class CustomPolicy:
    """``lambda_fn(module)`` returns ``False`` (not a unit), ``True`` (a unit with the root's settings) or a
    dict of constructor keyword overrides for that unit (e.g. ``{"sharding_strategy": "SHARD_GRAD_OP"}``)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool | dict[str, Any]:
        if recurse:
            return True
        result = self._lambda_fn(module)
        if not isinstance(result, (bool, dict)):
            raise TypeError(
                f"CustomPolicy's function returned {result!r} for {type(module).__name__}; "
                "it must return a bool or a dict of keyword overrides."
            )
        return result


@dataclass
class UnitPlan:
    """One module chosen to become a unit, with the keyword overrides its policy gave (if any)."""

    module: nn.Module
    overrides: dict[str, Any]


def _numel(module: nn.Module, ignored: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in ignored)


def plan_units(
    root: nn.Module,
    policy: PolicyFn | None,
    *,
    ignored_modules: Iterable[nn.Module] = (),
    is_unit: Callable[[nn.Module], bool] = lambda m: False,
) -> list[UnitPlan]:
    """The submodules of ``root`` (never ``root`` itself) that ``policy`` makes units, innermost first.

    Modules already units (``is_unit``) and ``ignored_modules`` are neither entered nor chosen.
    """
    if policy is None:
        return []
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy={policy!r} is not callable; pass ModuleWrapPolicy({{Block}}), "
            "functools.partial(size_based_auto_wrap_policy, min_num_params=N) or a function "
            "(module, recurse, nonwrapped_numel) -> bool."
        )
    ignored_mods = {id(m) for m in ignored_modules}
    ignored_params = {id(p) for m in ignored_modules for p in m.parameters()}
    plans: list[UnitPlan] = []

    def visit(module: nn.Module) -> int:
        """Plan units under ``module``; return how many of its parameters units below it claimed."""
        claimed = 0
        total = _numel(module, ignored_params)
        if policy(module, True, total):
            for child in module.children():
                if id(child) in ignored_mods:
                    continue
                if is_unit(child):
                    claimed += _numel(child, ignored_params)
                    continue
                child_claimed = visit(child)
                child_total = _numel(child, ignored_params)
                decision = policy(child, False, child_total - child_claimed)
                if decision:
                    plans.append(UnitPlan(child, decision if isinstance(decision, dict) else {}))
                    claimed += child_total
                else:
                    claimed += child_claimed
        return claimed

    visit(root)
    return plans


# --- manual wrapping ----------------------------------------------------------------------------------

_wrap_context = threading.local()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside this block, :func:`wrap` wraps with ``wrapper_cls(module, **wrapper_kwargs)``."""
    previous = getattr(_wrap_context, "config", None)
    _wrap_context.config = (wrapper_cls, wrapper_kwargs)
    try:
        yield
    finally:
        _wrap_context.config = previous


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the wrapper of the enclosing :func:`enable_wrap`; outside one, return it as is."""
    config = getattr(_wrap_context, "config", None)
    if config is None:
        return module
    wrapper_cls, kwargs = config
    return wrapper_cls(module, **{**kwargs, **wrap_overrides})
