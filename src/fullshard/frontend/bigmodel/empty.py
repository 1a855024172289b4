"""``init_empty_weights``: build a model without allocating its parameters (they live on the meta device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["init_empty_weights"]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Modules built in the block get their parameters on the meta device (and buffers too with
    ``include_buffers=True``); shapes and dtypes are kept, no memory is allocated. Materialise them before
    use, e.g. with ``FullyShardedDataParallelPlugin(param_init_fn=...)`` or ``module.to_empty(device=...)``.
    """
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(vars(param))  # attributes set on the parameter (e.g. by a library) stay
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
