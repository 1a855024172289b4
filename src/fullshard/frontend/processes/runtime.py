"""The process a training script runs in: its rank, the world, its device, and the process group.

[Note: single process]
``Accelerator()`` in a script started without a launcher (``python train.py``: no ``RANK`` / ``WORLD_SIZE`` in
the environment and no process group) initialises a process group of one rank (gloo on CPU, NCCL on CUDA)
over an in-memory store, so collectives, and a model wrapped by the engine (under a plugin or FSDP in the
environment; without, the Accelerator runs it as it is: [Note: one process without FSDP] in
``one_process.py``), work as in a launched run, and ``save_state`` writes the same folders (one shard each).
This keeps one code path for 1 and N processes, and a checkpoint saved by a single process loads into 2 and
back. Under ``fullshard launch`` / ``torchrun`` the
group is initialised from the environment (``env://``); a group the script initialised itself is used as it is.
The group this module creates is destroyed by :func:`shutdown` (``Accelerator.end_training``).

[Note: restarts]
torch's elastic agent (``fullshard launch --max_restarts N``) restarts the workers against the same store at
``MASTER_ADDR:MASTER_PORT``, and the keys the previous attempt wrote there (gloo's rank addresses, the
store barrier's counters) are still in it: a restarted rank reads a dead peer's address and fails with
``connectFullMesh ... Connection refused``, or waits forever on a counter that is already past. So under
the elastic agent the group is built over a ``PrefixStore`` named after ``TORCHELASTIC_RESTART_COUNT``: every
attempt starts from an empty key space. A group the script initialised itself does not get this.

[Note: timeout]
Every collective of the group gives up after ``timeout`` (``InitProcessGroupKwargs(timeout=...)``, else
``FULLSHARD_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT`), so a desynchronised or dead peer ends in an
error instead of torch's 30-minute wait (gloo's default).

[Note: device]
A process computes on the CPU (``cpu=True``, or no CUDA) or on ``cuda:<local rank % devices>``. As in
Accelerate, ``ACCELERATE_TORCH_DEVICE`` (e.g. ``cuda:1``) names the device instead; the process group's backend
then follows it (NCCL for a CUDA device, gloo otherwise).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "ProcessState", "ProcessView", "init_process_state", "resolve_timeout", "shutdown"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
TIMEOUT_VAR = "FULLSHARD_TIMEOUT"
DEVICE_VAR = "ACCELERATE_TORCH_DEVICE"

_OWNED_GROUP = False


@dataclass(frozen=True)
class ProcessState:
    """Where this process stands; equal on every rank except ``process_index`` / ``local_process_index``."""

    process_index: int
    num_processes: int
    local_process_index: int
    device: torch.device
    backend: str

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        """Barrier over all processes (no-op with one)."""
        if self.num_processes > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on the main (or local main) process first, then on the others."""
        first = self.is_local_main_process if local else self.is_main_process
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)


class ProcessView:
    """What the Accelerator and ``PartialState`` both answer from their :class:`ProcessState` (``self._process``)."""

    _process: ProcessState

    device = property(lambda self: self._process.device, doc="The device this process computes on.")
    process_index = property(lambda self: self._process.process_index, doc="Global rank.")
    local_process_index = property(lambda self: self._process.local_process_index, doc="Rank on this machine.")
    num_processes = property(lambda self: self._process.num_processes, doc="World size.")
    is_main_process = property(lambda self: self._process.is_main_process, doc="Global rank 0.")
    is_local_main_process = property(lambda self: self._process.is_local_main_process, doc="Local rank 0.")

    def wait_for_everyone(self) -> None:
        self._process.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self._process.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self._process.main_process_first(local=True)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._process.print(*args, **kwargs)


def _named_device() -> torch.device | None:
    """The device ``ACCELERATE_TORCH_DEVICE`` names, or ``None`` when it is unset; see [Note: device]."""
    raw = os.environ.get(DEVICE_VAR, "").strip()
    if not raw:
        return None
    try:
        return torch.device(raw)
    except RuntimeError:
        raise ValueError(
            f"{DEVICE_VAR}={raw!r}: not a torch device. Name one as torch.device takes it (cpu, cuda, cuda:1), or "
            "unset the variable to let fullshard pick this process's device."
        ) from None


def _pick_device(cpu: bool, local_rank: int, named: torch.device | None = None) -> torch.device:
    if named is not None:
        if named.type == "cuda":
            torch.cuda.set_device(named)
        return named
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_timeout(timeout: timedelta | None = None) -> timedelta:
    """``timeout``, else ``FULLSHARD_TIMEOUT`` (seconds), else :data:`DEFAULT_TIMEOUT`; see [Note: timeout]."""
    if timeout is not None:
        return timeout
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(
            f"{TIMEOUT_VAR}={raw!r}: expected a positive number of seconds, e.g. {TIMEOUT_VAR}=300. It bounds how "
            "long a rank waits for the others in a collective."
        )
    return timedelta(seconds=seconds)


def init_process_state(
    cpu: bool = False, timeout: timedelta | None = None, backend: str | None = None, init_method: str | None = None
) -> ProcessState:
    """Initialise (or adopt) the default process group and return this process's state.

    See [Note: single process], [Note: restarts] and [Note: timeout]. ``cpu`` forces the CPU (and gloo) even
    when CUDA is available; ``backend`` and ``init_method`` override fullshard's choice. Without ``LOCAL_RANK``
    in the environment the global rank stands for the local one (all ranks on one machine).
    """
    global _OWNED_GROUP
    named = _named_device()
    use_cuda = named.type == "cuda" if named is not None else not cpu and torch.cuda.is_available()
    if not dist.is_initialized():
        backend = backend or ("nccl" if use_cuda else "gloo")
        kwargs: dict[str, Any] = {"timeout": resolve_timeout(timeout)}
        if init_method is not None:
            dist.init_process_group(backend, init_method=init_method, **kwargs)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend, store=_launcher_store(rank, world_size, kwargs["timeout"]), rank=rank, world_size=world_size,
                **kwargs,
            )  # fmt: skip
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        _OWNED_GROUP = True
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = _pick_device(not use_cuda or "nccl" not in backend, local_rank, named)
    return ProcessState(
        process_index=dist.get_rank(),
        num_processes=dist.get_world_size(),
        local_process_index=local_rank,
        device=device,
        backend=backend,
    )


def _launcher_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launcher's store (``env://``: MASTER_ADDR/PORT), under a per-attempt prefix; see [Note: restarts]."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return store
    return dist.PrefixStore(f"fullshard/attempt{attempt}/", store)


# How long :func:`shutdown` leaves the GIL to torch's collective threads; see [Note: ending a worker] in
# ``fullshard/cli/worker.py``. A worker thread that finished the last barrier may still be freeing it (and
# the collectives it kept alive), which takes the GIL; if the interpreter is finalizing by then, the process
# aborts. Under ``fullshard launch`` the worker skips the teardown altogether; this covers ``torchrun``.
_COLLECTIVE_THREADS_GRACE_S = 0.05


def shutdown() -> None:
    """Destroy the process group if :func:`init_process_state` created it (else leave it to its owner)."""
    global _OWNED_GROUP
    if _OWNED_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_COLLECTIVE_THREADS_GRACE_S)
    _OWNED_GROUP = False
