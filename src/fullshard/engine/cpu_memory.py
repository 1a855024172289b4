"""Freed CPU memory kept by the C allocator, so that a step does not fault its buffers in again.

A sharded step frees and allocates buffers of a unit's size all the time (gathered parameters, the unsharded
gradient, the reduced shard, activations around them). On CPU, torch allocates with the C library's ``malloc``,
and glibc's defaults hand much of that memory back to the kernel: chunks above a threshold that glibc moves with
the sizes it sees are mapped and unmapped on each use, and the top of the heap is trimmed whenever more than twice
that threshold is free there. Each reuse is then a fresh mapping that the kernel faults in and zeroes page by page.
On the medium GPT of ``benchmarks/train.py steps`` that was 8,000 to 18,000 minor faults per step and rank under
FULL_SHARD (DDP, which keeps its buckets, took next to none), and a 12 MiB copy that normally takes 1 ms took
33-48 ms when it faulted: a stall at a random place on one rank, which the other rank then waits out at the next
collective. On GPU the caching allocator keeps freed memory for reuse; this is its CPU counterpart, one setting
per process: glibc keeps freed memory up to :data:`MMAP_THRESHOLD_BYTES` per chunk in its heap and trims the heap
only above :data:`TRIM_THRESHOLD_BYTES`, so the peak is the same and later steps reuse it (chunks above the
mapping threshold, which glibc cannot keep, are what ``spare.py`` hands from unit to unit).

Invariants: applied at most once per process, when the first root unit whose parameters compute on CPU
initializes; never when the user chose for themselves (``FULLSHARD_CPU_KEEP_FREED_MEMORY=0``, any of glibc's
``MALLOC_*`` variables or ``glibc.malloc`` tunables set), nor where the C library is not glibc. It changes no
number a step computes, only where its memory comes from.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

__all__ = ["ENV", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory", "allocator_set_by_user"]

ENV = "FULLSHARD_CPU_KEEP_FREED_MEMORY"
"""``0`` leaves the C allocator's settings as they are."""

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest mapping threshold on 64-bit builds: chunks up to it come from the heap and are reused there."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free memory at the heap's top kept before glibc returns it (mallopt takes an ``int``: its largest value)."""

# mallopt's parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The environment variables glibc reads for the same settings (man mallopt), and its tunables' namespace.
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: bool | None = None  # None: not decided yet in this process


def allocator_set_by_user(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the user set the allocator up themselves (or turned this off): their choice is left alone."""
    return (
        environ.get(ENV, "1").strip() == "0"
        or any(name in environ for name in _USER_SETTINGS)
        or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    )


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (once per process; see the module's docstring). Returns whether
    this process runs with the setting, whichever call applied it."""
    global _applied
    if _applied is None:
        _applied = not allocator_set_by_user() and _mallopt_all()
    return _applied


def _mallopt_all() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mapping threshold first: setting either one fixes both (glibc stops moving them with the sizes it sees).
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
