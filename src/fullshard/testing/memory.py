"""This process's resident memory, now and at its peak, as the kernel counts it (Linux procfs).

[Note: which peak]
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is not this program's peak. Linux keeps the high-water mark
of the memory image a process had *before* ``execve`` and reports the larger of the two; a child started
with ``fork`` + ``exec`` (``multiprocessing``'s "spawn", ``subprocess``) begins as a copy of its parent, so
its ``ru_maxrss`` is at least the parent's resident size at the fork. Ranks spawned from a pytest session
that had grown to 1 GB reported a 1.06 GB peak where the same ranks spawned from a small driver reported
0.60 GB. ``VmHWM`` in ``/proc/self/status`` belongs to the current memory image, which ``exec`` replaces:
it starts from the child's own first page, and writing ``5`` to ``/proc/self/clear_refs`` resets it to
the current RSS (to leave imports or set-up out of a measurement).
"""

from __future__ import annotations

import os

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """The largest resident set size of this process's memory image since it was exec'd or since the last
    :func:`reset_peak_rss` (never its parent's; see [Note: which peak])."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS needs Linux procfs")


def reset_peak_rss() -> None:
    """Start :func:`peak_rss_bytes` again from the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
