"""Load the small files of a checkpoint (scheduler, sampler, RNG states, ...) without unpickling arbitrary objects.

Every file goes through ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples and
dicts only. The one exception is the RNG state file that Accelerate writes (``random_states_<rank>.pkl``):
it holds numpy's generator state as a numpy array, so :func:`load_rng_file` admits exactly the numpy
globals that array needs (``numpy.ndarray``, ``numpy.dtype`` and its uint32 class, and the array
reconstructor under its numpy 1 and numpy 2 names), for that one load only.

Errors name the file: a pickle that asks for anything else is refused as a crafted or foreign file, and a
truncated or corrupt file is called that (torch's own message, which suggests ``weights_only=False``, is
not repeated: following that advice would run whatever the file says).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from fullshard.checkpoint.errors import CheckpointFileError

__all__ = ["CheckpointFileError", "load_rng_file", "load_small_file"]

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype("uint32"))]
    # Files pickled by numpy 1 name the reconstructor numpy.core..., by numpy 2 numpy._core...
    allowed += [(_reconstruct, "numpy.core.multiarray._reconstruct"),
                (_reconstruct, "numpy._core.multiarray._reconstruct")]  # fmt: skip
    return allowed


def load_small_file(path: str | os.PathLike[str], *, extra_globals: list[Any] | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` with errors that name the file (:class:`CheckpointFileError`)."""
    path = Path(path)
    try:
        if extra_globals:
            with torch.serialization.safe_globals(extra_globals):
                return torch.load(path, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path} is missing: the checkpoint is incomplete; load another one.") from None
    except pickle.UnpicklingError as exc:
        found = _GLOBAL_RE.search(str(exc))
        what = f"it asks for {found.group(1)}" if found else "it holds more than tensors and plain values"
        if found is None and "GLOBAL" not in str(exc) and "Unsupported" not in str(exc):
            raise CheckpointFileError(f"{path} is corrupt ({_first_line(exc)}): load another checkpoint.") from None
        raise CheckpointFileError(
            f"{path} was refused: {what}, which fullshard does not unpickle from a checkpoint (only tensors, "
            "numbers, strings, lists and dicts). The file is foreign or crafted; load a checkpoint saved by "
            "save_state, or keep such state out of state_dict()."
        ) from None
    except Exception as exc:
        raise CheckpointFileError(
            f"{path} is truncated or corrupt ({_first_line(exc)}): load another checkpoint."
        ) from None


def load_rng_file(path: str | os.PathLike[str]) -> Any:
    """A ``random_states_<rank>.pkl`` of fullshard or Accelerate (numpy's state as an array is admitted)."""
    return load_small_file(path, extra_globals=_numpy_globals())


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].split('. ')[0] if lines else ''}"
