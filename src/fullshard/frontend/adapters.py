"""PEFT adapters on sharded models: recognising a PEFT model behind the wrappers.

``is_peft_model`` is Accelerate's check (TRL and transformers import it from ``accelerate.utils``): the model
``extract_model_from_parallel`` returns is a ``peft.PeftModel``. ``peft`` is imported only when it is installed
and only when asked, so fullshard never needs it.
"""

from __future__ import annotations

from torch import nn

from fullshard.frontend.availability import is_peft_available
from fullshard.frontend.training import extract_model_from_parallel

__all__ = ["is_peft_model"]


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (a prepared model, or the user's module) is a ``peft.PeftModel``."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)
