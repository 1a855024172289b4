"""``cast_floating`` (the engine's input and output casts) keeps every container's type.

Check: mappings (``OrderedDict`` subclasses with attribute access, ``defaultdict`` with its factory, read-only
mappings), named tuples, dataclasses and nested mixes come back as the same classes with their floating-point
tensors cast and everything else (integer tensors, strings, ``None``) untouched.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, NamedTuple

import torch

from fullshard.engine.precision import cast_floating


class AttrDict(collections.OrderedDict):
    """A mapping whose items are also attributes (the shape of Hugging Face's ``ModelOutput``)."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class Pair(NamedTuple):
    hidden: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    extra: dict[str, Any]
    note: str = "kept"
    derived: float = dataclasses.field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.derived = float(self.loss.float().sum())


def test_every_container_keeps_its_type_and_floats_are_cast() -> None:
    f, i = torch.ones(2), torch.arange(2)
    attr = AttrDict()
    attr["loss"] = f
    attr["ids"] = i
    counts = collections.defaultdict(list, {"x": [f]})
    value = {
        "attr": attr,
        "counts": counts,
        "pair": Pair(f, i),
        "output": Output(loss=f, extra={"t": (f, None, "s")}),
        "frozen": types.MappingProxyType({"f": f}),
    }
    out = cast_floating(value, torch.bfloat16)
    assert type(out["attr"]) is AttrDict and out["attr"].loss.dtype == torch.bfloat16
    assert out["attr"].loss is out["attr"]["loss"] and out["attr"]["ids"] is i
    assert list(out["attr"].keys()) == ["loss", "ids"]
    assert type(out["counts"]) is collections.defaultdict and out["counts"].default_factory is list
    assert out["counts"]["x"][0].dtype == torch.bfloat16
    assert type(out["pair"]) is Pair and out["pair"].hidden.dtype == torch.bfloat16 and out["pair"].ids is i
    assert type(out["output"]) is Output and out["output"].loss.dtype == torch.bfloat16
    assert out["output"].extra["t"][0].dtype == torch.bfloat16 and out["output"].extra["t"][1:] == (None, "s")
    assert out["output"].derived == 2.0 and out["output"].note == "kept"
    assert out["frozen"]["f"].dtype == torch.bfloat16
    # the input is not modified in place
    assert attr["loss"].dtype == torch.float32 and value["output"].loss.dtype == torch.float32


def test_no_dtype_returns_the_object_itself() -> None:
    value = {"a": torch.ones(1)}
    assert cast_floating(value, None) is value
