"""The names of Accelerate's API that PEFT, TRL and transformers use on a PEFT model behave as Accelerate's do:
``is_peft_model``, ``named_module_tensors``, ``remove_hook_from_module`` / ``remove_hook_from_submodules``,
``get_parameters_from_modules`` (each compared with the real Accelerate's answer on the same module)."""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn

from fullshard.frontend.bigmodel.hooks import remove_hook_from_module, remove_hook_from_submodules
from fullshard.frontend.prepare import get_parameters_from_modules
from fullshard.utils import is_peft_model, named_module_tensors

accelerate_hooks = pytest.importorskip("accelerate.hooks")
accelerate_utils = pytest.importorskip("accelerate.utils")
accelerate_fsdp_utils = pytest.importorskip("accelerate.utils.fsdp_utils")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2)))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    model[2].register_buffer("kept", torch.ones(2))
    return model


def test_is_peft_model_sees_through_the_wrappers() -> None:
    lora = peft.get_peft_model(_model(), peft.LoraConfig(target_modules=["0"]))
    for model in (lora, _model(), nn.parallel.DataParallel(lora)):
        assert is_peft_model(model) == accelerate_utils.is_peft_model(model)
    assert is_peft_model(lora) and not is_peft_model(_model())


@pytest.mark.parametrize("recurse", [False, True])
@pytest.mark.parametrize("include_buffers", [False, True])
@pytest.mark.parametrize("remove_non_persistent", [False, True])
def test_named_module_tensors_as_accelerate(recurse: bool, include_buffers: bool, remove_non_persistent: bool) -> None:
    model = _model()
    kwargs = {"recurse": recurse, "include_buffers": include_buffers, "remove_non_persistent": remove_non_persistent}
    ours = [(n, t.data_ptr()) for n, t in named_module_tensors(model, **kwargs)]
    theirs = [(n, t.data_ptr()) for n, t in accelerate_utils.named_module_tensors(model, **kwargs)]
    assert ours == theirs


def test_removing_a_hook_restores_the_module() -> None:
    model = _model()
    x = torch.randn(3, 4)
    model.eval()
    before = model(x)
    accelerate_hooks.add_hook_to_module(model[0], accelerate_hooks.ModelHook())
    accelerate_hooks.add_hook_to_module(model[2][0], accelerate_hooks.ModelHook())
    assert hasattr(model[0], "_hf_hook") and "forward" in model[0].__dict__
    remove_hook_from_submodules(model)
    for module in model.modules():
        assert not {"_hf_hook", "_old_forward"} & set(module.__dict__)
        assert module.forward.__func__ is type(module).forward
    assert torch.equal(model(x), before)
    assert remove_hook_from_module(model[1]) is model[1]  # no hook: unchanged


def test_get_parameters_from_modules_as_accelerate() -> None:
    model = _model()
    for modules in (None, r"2\.0", [model[0]], r"\d"):
        ours = get_parameters_from_modules(modules, model, "cpu")
        assert ours == accelerate_fsdp_utils.get_parameters_from_modules(modules, model, "cpu")
    assert get_parameters_from_modules(r"2\.0", model, "cpu") == set(model[2][0].parameters())


def test_get_module_class_from_name_as_accelerate() -> None:
    from fullshard.accelerate.utils.dataclasses import get_module_class_from_name

    accelerate_dataclasses = pytest.importorskip("accelerate.utils.dataclasses")
    model = _model()
    for name in ("Sequential", "Linear", "BatchNorm1d", "Conv2d"):
        ours = get_module_class_from_name(model, name)
        assert ours is accelerate_dataclasses.get_module_class_from_name(model, name)
    assert get_module_class_from_name(model, "BatchNorm1d") is nn.BatchNorm1d
