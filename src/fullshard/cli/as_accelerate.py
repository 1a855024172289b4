"""``--as_accelerate``: every ``import accelerate...`` of a script (and of the libraries it uses) resolves to
fullshard's mirror package ``fullshard.accelerate``, installed or not the real Accelerate.

[Note: serving accelerate]
:func:`install` puts :class:`AccelerateMirror` first on ``sys.meta_path``. For ``accelerate`` and
``accelerate.<x>`` it imports ``fullshard.accelerate.<x>`` and makes it *be* the requested module: the loader
replaces its ``sys.modules`` entry by the mirror module (the import system returns what ``sys.modules`` holds
after ``exec_module``), so ``accelerate.Accelerator is fullshard.Accelerator`` and no module is loaded twice. A
path the mirror lacks raises ``ModuleNotFoundError`` naming it, rather than falling through to the real
Accelerate (mixing the two would put Accelerate's DDP under fullshard's state). The same finder answers
``importlib.metadata`` for the distribution ``accelerate`` (version :data:`ACCELERATE_VERSION`), which is how
transformers' ``is_accelerate_available`` decides to enable the ``Trainer``.

Who installs it: the worker of ``fullshard launch`` (``fullshard/cli/worker.py``) when ``FULLSHARD_AS_ACCELERATE=1``
is in its environment, which ``fullshard launch --as_accelerate`` sets. A plain ``python script.py`` imports no
fullshard code before the script, so the variable alone cannot act there (that would need a ``.pth`` file in
site-packages); under torchrun, run the worker module: ``FULLSHARD_AS_ACCELERATE=1 torchrun ... -m
fullshard.cli.worker script.py`` or, equivalently, ``torchrun ... -m fullshard.cli.as_accelerate script.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["ACCELERATE_VERSION", "ENV_VAR", "AccelerateMirror", "install", "installed", "requested"]

ENV_VAR = "FULLSHARD_AS_ACCELERATE"
MIRROR = "fullshard.accelerate"
ACCELERATE_VERSION = "1.15.0"
_USE_FSDP_VAR = "ACCELERATE_USE_FSDP"


def requested(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether ``FULLSHARD_AS_ACCELERATE`` asks for the mirror (``1``/``true``/``yes``, any case)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes")


class _Alias(importlib.abc.Loader):
    """Loads ``accelerate.<x>`` as ``fullshard.accelerate.<x>``; see [Note: serving accelerate]."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _AccelerateDistribution(importlib.metadata.Distribution):
    """The metadata of the ``accelerate`` distribution fullshard serves (name and version only)."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (
                f"Metadata-Version: 2.1\nName: accelerate\nVersion: {ACCELERATE_VERSION}\n"
                "Summary: Accelerate's API served by fullshard (fullshard launch --as_accelerate)\n"
            )
        return None

    def locate_file(self, path: Any) -> Any:
        spec = importlib.util.find_spec(MIRROR)
        origin = os.path.dirname(spec.origin) if spec and spec.origin else "."
        return os.path.join(origin, str(path))


class AccelerateMirror(importlib.abc.MetaPathFinder):
    """Finds ``accelerate`` and its submodules in ``fullshard.accelerate``; see [Note: serving accelerate]."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "accelerate" and not fullname.startswith("accelerate."):
            return None
        mirror = MIRROR + fullname[len("accelerate") :]
        found = importlib.util.find_spec(mirror)
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under --as_accelerate (FULLSHARD_AS_ACCELERATE=1) `accelerate` is "
                f"fullshard's mirror, which has no {mirror}. Import the names from accelerate or accelerate.utils, "
                "or run without --as_accelerate to use the real Accelerate.",
                name=fullname,
            )
        return importlib.util.spec_from_loader(
            fullname, _Alias(mirror), is_package=found.submodule_search_locations is not None
        )

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "accelerate":
            yield _AccelerateDistribution()


def installed() -> bool:
    return any(isinstance(finder, AccelerateMirror) for finder in sys.meta_path)


def install() -> None:
    """Serve ``accelerate`` from fullshard in this process (idempotent); see [Note: serving accelerate].

    Also sets ``ACCELERATE_USE_FSDP=true`` unless it is set, when several processes run (``WORLD_SIZE`` > 1):
    there every prepared model is sharded, and transformers' ``cpu_ram_efficient_loading`` (rank 0 alone reads
    the pretrained weights) looks for it. One process keeps Accelerate's ``DistributedType.NO`` unless FSDP is
    asked for (see [Note: one process without FSDP] in ``frontend/one_process.py``).
    """
    if installed():
        return
    loaded = sys.modules.get("accelerate")
    if loaded is not None and getattr(loaded, "__name__", "") != MIRROR:
        raise RuntimeError(
            "--as_accelerate (FULLSHARD_AS_ACCELERATE=1): the real `accelerate` is already imported in this "
            "process, so it cannot be served by fullshard any more. Install the redirect before anything imports "
            "accelerate (start the script with fullshard launch --as_accelerate)."
        )
    sys.meta_path.insert(0, AccelerateMirror())
    importlib.invalidate_caches()
    # With several processes every model an Accelerator prepares is sharded, so say so as `accelerate launch
    # --use_fsdp` does: transformers' from_pretrained reads this (with FSDP_CPU_RAM_EFFICIENT_LOADING, which
    # TrainingArguments writes from fsdp_config) to load the weights on rank 0 only and build the model on meta
    # elsewhere.
    if _world_size() > 1:
        os.environ.setdefault(_USE_FSDP_VAR, "true")


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1  # the process group's own setup names a malformed WORLD_SIZE
