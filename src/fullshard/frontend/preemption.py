"""A stop flag every rank agrees on: Accelerate's ``set_trigger`` / ``check_trigger``, and preemption signals.

[Note: preemption]
A cluster scheduler preempts a job by sending SIGTERM to the launcher, which forwards it to every worker
and kills them after a grace period (``fullshard launch --shutdown_timeout``, 30 s by default). A worker that
wants to stop cleanly calls :func:`install_preemption_handler` once: the signal then only sets this process's
trigger, and the training loop polls :func:`check_trigger` once per step, a collective that is true on every
rank when any rank set it (the signal need not reach all ranks at the same step, and a rank that polls at a
step boundary never leaves the others inside a collective). The loop then saves a checkpoint and returns, and
the worker exits 0. Without the handler SIGTERM ends the worker at once (Python's default).

Invariant: the trigger is per process, not per Accelerator, because a signal handler has no Accelerator to
reach; :func:`check_trigger` clears it on every rank when it returns True, as Accelerate does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["check_trigger", "install_preemption_handler", "preemption_signal", "set_trigger"]

_trigger = threading.Event()
_received: list[signal.Signals] = []


def set_trigger() -> None:
    """Raise this process's stop flag; the next :func:`check_trigger` is True on every rank."""
    _trigger.set()


def check_trigger(device: torch.device | None = None) -> bool:
    """True on every rank when any rank called :func:`set_trigger` since the last True; then clears it.

    A collective: every rank must call it at the same point of the loop.
    """
    flag = torch.tensor([1 if _trigger.is_set() else 0], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) >= 1:
        _trigger.clear()
        return True
    return False


def preemption_signal() -> signal.Signals | None:
    """The last signal :func:`install_preemption_handler` caught in this process, or None."""
    return _received[-1] if _received else None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    _received.append(signal.Signals(signum))
    _trigger.set()


def install_preemption_handler(signals: Iterable[signal.Signals] = (signal.SIGTERM,)) -> None:
    """Make ``signals`` (default SIGTERM) set the trigger instead of ending the process; see [Note: preemption].

    Call it from the main thread (Python delivers signals there) before the training loop.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "install_preemption_handler() was called outside the main thread: Python installs signal handlers "
            "from the main thread only. Call it at the start of the training script."
        )
    for sig in signals:
        signal.signal(sig, _on_signal)
