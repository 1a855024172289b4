"""PEFT adapters on sharded models: recognising a PEFT model behind the wrappers, and saving its adapter whole.

``is_peft_model`` is Accelerate's check (TRL and transformers import it from ``accelerate.utils``): the model
``extract_model_from_parallel`` returns is a ``peft.PeftModel``. It never imports ``peft`` (a model can only be
one once the user imported it); the functions that save an adapter import it, so fullshard never needs it.

[Note: saving a sharded adapter]
PEFT's ``save_pretrained(d)`` without ``state_dict=`` takes ``model.state_dict()``. Under ``fully_shard`` its
values are ``DTensor`` shards (torch's contract, which checkpoints rely on), which PEFT cannot write: rank 0 fails
in safetensors and the other ranks run on. So ``prepare`` gives a ``fully_shard`` PEFT model its own
``save_pretrained`` (on the instance, as mixed precision wraps ``forward``): without ``state_dict=`` it first
asks PEFT which entries each adapter saves, gathers just those whole on every rank (one ``full_tensor`` each,
in state-dict order), and hands them over as ``state_dict=``. Like every state dict of a sharded model it is a
collective: call it on every rank, with ``is_main_process=accelerator.is_main_process``. The FSDP class needs
none of this: its nested wrappers gather their own entries, and its names are those PEFT matches
(``named_modules`` in ``engine/wrapper.py``).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.frontend.training import extract_model_from_parallel

__all__ = ["full_adapter_state_dict", "is_peft_model", "save_adapters_whole"]


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (a prepared model, or the user's module) is a ``peft.PeftModel``.

    Never imports peft: a model can only be a ``PeftModel`` once peft is imported, and importing it (with
    transformers, torchao, scipy and the rest it pulls in) costs seconds of every ``prepare``."""
    peft_model = getattr(sys.modules.get("peft"), "PeftModel", None)
    return peft_model is not None and isinstance(extract_model_from_parallel(model), peft_model)


def full_adapter_state_dict(model: nn.Module) -> dict[str, Any]:
    """The entries of ``model.state_dict()`` that PEFT saves for any of its adapters, whole (a collective)."""
    from peft import get_peft_model_state_dict

    state = model.state_dict()
    wanted = {
        id(value)
        for name in model.peft_config  # type: ignore[union-attr]
        for value in get_peft_model_state_dict(model, state_dict=state, adapter_name=name).values()
    }
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else value
        for key, value in state.items()
        if id(value) in wanted
    }


def save_adapters_whole(model: nn.Module) -> None:
    """Give a ``fully_shard`` PEFT model a ``save_pretrained`` that writes whole adapters; see the Note above."""
    if not is_peft_model(model) or "save_pretrained" in model.__dict__:
        return
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return
    original = model.save_pretrained

    @functools.wraps(original)
    def save_pretrained(save_directory: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            with torch.no_grad():
                kwargs["state_dict"] = full_adapter_state_dict(model)
        return original(save_directory, *args, **kwargs)

    model.save_pretrained = save_pretrained  # type: ignore[method-assign]
