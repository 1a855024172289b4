"""A package surface whose names are imported on first use (PEP 562), so that importing a package, or any module
under it, does not import every module its ``__init__`` re-exports.

A surface's ``__init__`` writes its re-exports as it would eagerly, inside ``if TYPE_CHECKING:`` (type checkers and
the layer test read them there), then ``__getattr__, __dir__ = lazy_surface(__name__, __file__)``. Standard library
only: every package may import this module (it imports no layer).
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["lazy_surface"]


def lazy_surface(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package ``package`` whose ``__init__`` is ``init_file``: a name of its
    ``if TYPE_CHECKING:`` imports is imported from its module when first read, then bound on the package."""
    module = sys.modules[package]
    sources: dict[str, tuple[str, str]] = {}  # name -> (module, attribute), read on the first lookup

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module's, PEP 562)
        if not sources:
            sources.update(_imports_of(init_file))
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        source, attribute = sources[name]
        if source == package:  # ``from package import submodule``
            value: Any = importlib.import_module(f"{package}.{attribute}")
        else:
            value = getattr(importlib.import_module(source), attribute)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted({*vars(module), *getattr(module, "__all__", ())})

    module.__class__ = _Surface
    return __getattr__, __dir__


def _imports_of(init_file: str) -> dict[str, tuple[str, str]]:
    tree = ast.parse(Path(init_file).read_text(), filename=init_file)
    block = next(n for n in tree.body if isinstance(n, ast.If))
    imports = [n for n in block.body if isinstance(n, ast.ImportFrom)]
    return {a.asname or a.name: (n.module or "", a.name) for n in imports for a in n.names}


class _Surface(ModuleType):
    """A lazy package. Importing a submodule binds it on its package; where the submodule is named as a surface
    name it defines (``fullshard.engine.fully_shard`` and its ``fully_shard``), that name stays bound, as an eager
    ``from package.fully_shard import fully_shard`` left it, whichever imports the submodule first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
            and name in getattr(self, "__all__", ())
            and hasattr(value, name)
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)
