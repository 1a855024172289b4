"""Saves that do not stop training: the state is copied to host memory, then written and committed in a thread.

[Note: background saves]
``save_state(dir, async_save=True)`` splits one save ([Note: whole-checkpoint commit] in ``transaction.py``)
in two. In the caller's thread, on every rank: wait for the previous background save (:func:`wait`); build the
state dicts (their collectives, if any, run on the default group, as in a synchronous save); claim the staging
folder (``begin``); copy every tensor of this rank to host memory and every small object whole
(:func:`host_copy` into the kept buffers: later optimizer steps change the parameters in place). Then
:func:`start` runs the rest in a thread: every ``step`` (DCP's writes, the small files, each file checksummed as
it goes out), the ``commit`` and the rotation of old checkpoints. The bytes written are the synchronous save's:
the same state dicts, the same writers.

The thread's collectives (DCP's plan exchange, each step's agreement, the commit's gather) run on
:func:`save_group`, a gloo group over every rank created once per default group and used by nothing else.
On one group, collectives pair up across ranks in the order each rank issues them; if the thread used the
training's group, rank 0's save gather could meet rank 1's gradient reduce-scatter. Two groups are two
independent sequences, so training and saving never interleave, whatever the threads' timing.

Who waits: the next ``save_state``, ``load_state`` and ``end_training`` call :func:`wait`, and so does process
exit (the thread is not a daemon: the interpreter, or ``fullshard launch``'s worker, joins it before the
``atexit`` handlers run). A failure in the thread is kept and raised by the next :func:`wait` on that rank as
:class:`BackgroundSaveError` (the transaction's message: the step, every failing rank, the file, and that
``dir`` is unchanged); at process exit with no one left to wait, it is printed to stderr. The transaction
already made every rank fail alike, so every rank raises at the same call. A process killed during the
background write leaves what a killed synchronous save leaves: the staging folder, never loaded, and ``dir``
as it was.

The host copy goes into :class:`HostBuffers` kept from the previous async save (same key, shape and dtype:
``copy_``, no page faults; else new memory), so after the first async save a call costs a memcpy. Cost: one
copy of this rank's sharded model and optimizer state stays in host memory (pinned for CUDA state) from the
first async save until :func:`release` (``end_training``) or process exit; the thread competes with training
for the GIL and the cores. The buffers are written only after :func:`wait`, so never while a write reads them.
"""

from __future__ import annotations

import atexit
import copy
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard.checkpoint.errors import BackgroundSaveError

__all__ = [
    "BackgroundSaveError", "HostBuffers", "buffers", "host_copy", "pending", "release", "save_group", "start", "wait",
]  # fmt: skip


class HostBuffers:
    """The host tensors of the last background save's copy, kept and refilled by the next one.

    Keyed by where a tensor sits in the state dicts (the part and its state-dict key path): the next save's
    tensor at the same key with the same shape and dtype is copied into the same host tensor with ``copy_``
    (about 10x faster than copying into new memory, whose pages fault in on first write); another shape or dtype,
    or a new key, gets a new tensor, and a key the save no longer has is dropped. A tensor of a CUDA state is
    copied into pinned memory. Holds one copy of this rank's sharded model and optimizer state (with fp32
    AdamW, 12 bytes per parameter divided by the number of ranks) from the first async save until
    :func:`release` (``end_training``) or process exit. Only :func:`host_copy` of the caller's thread writes
    them, after :func:`wait` returned (the background write that reads them has ended).
    """

    def __init__(self) -> None:
        self.tensors: dict[tuple[Any, ...], torch.Tensor] = {}
        self.used: dict[tuple[Any, ...], torch.Tensor] = {}
        self.pending_devices: set[torch.device] = set()  # copies queued into pinned memory, not yet waited for

    def copy(self, tensor: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor:
        """A host tensor with ``tensor``'s values: the kept one for ``key`` if it fits, else a new one."""
        source = tensor.detach()
        pin = source.device.type == "cuda"
        buffer = self.tensors.get(key)
        if (
            buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype
            or buffer.is_pinned() != pin
            or buffer.stride() != torch.empty_like(source, device="meta").stride()  # clone's strides
        ):  # fmt: skip
            buffer = torch.empty_like(source, device="cpu", pin_memory=pin)
        # Into pinned memory the copy is queued on the GPU's stream, overlapping the next ones; finish() waits
        # for them. Into pageable memory it is synchronous: the values are final when it returns.
        buffer.copy_(source, non_blocking=pin)
        self.pending_devices.update([source.device] if pin else [])
        self.used[key] = buffer
        return buffer

    def begin(self) -> None:
        """Start a save's copy: nothing used yet (a copy that failed half-way leaves the kept tensors as they were)."""
        self.used = {}

    def finish(self) -> None:
        """Wait for the queued device-to-host copies, then keep the tensors this save used (for the next one) and
        drop the rest. Every value is final when it returns."""
        for device in self.pending_devices:
            torch.cuda.synchronize(device)
        self.pending_devices = set()
        self.tensors, self.used = self.used, {}

    def nbytes(self) -> int:
        """Bytes of host memory held."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())


_BUFFERS = HostBuffers()


def buffers() -> HostBuffers:
    """The host buffers kept between background saves (see :class:`HostBuffers`)."""
    return _BUFFERS


def release() -> None:
    """Wait for the background save (if any), then free the kept host buffers (``end_training`` calls it)."""
    wait()
    _BUFFERS.tensors.clear()
    _BUFFERS.used.clear()


def _copy_tensor(tensor: torch.Tensor, key: tuple[Any, ...], kept: HostBuffers | None) -> torch.Tensor:
    """A host tensor with ``tensor``'s values, sharing no memory with it (strides kept, as ``clone``)."""
    if kept is not None and tensor.layout is torch.strided:
        return kept.copy(tensor, key)
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    return tensor.detach().to("cpu")  # a copy, synchronous: the values are final when it returns


def host_copy(
    value: Any,
    _memo: dict[int, Any] | None = None,
    *,
    kept: HostBuffers | None = None,
    key: tuple[Any, ...] = (),
) -> Any:
    """``value`` (a sharded state dict: nested dicts, lists and tuples) with every tensor copied to host memory.

    A ``DTensor`` stays a ``DTensor`` of the same mesh, placements and global shape around a copy of its local
    shard, so DCP writes it exactly as it writes the original; a tensor met twice is copied once. Other leaves
    (numbers, strings) are deep-copied. A state written whole with ``torch.save`` is copied with
    ``copy.deepcopy`` instead, which keeps storages shared between its tensors shared (the same bytes again).

    ``kept``: copy each tensor into the host buffer kept for its ``key`` path (``key`` prefixed) by the previous
    save when it fits (:class:`HostBuffers`); the caller must have waited for the write that read them.
    See [Note: background saves].
    """
    memo = {} if _memo is None else _memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.device.type == "cpu" or kept is not None:
            out: Any = DTensor.from_local(
                _copy_tensor(local, key, kept), value.device_mesh, value.placements,
                run_check=False, shape=value.shape, stride=value.stride(),
            )  # fmt: skip
        else:
            out = value.to("cpu")  # torch's async_save stages a DTensor the same way
    elif isinstance(value, torch.Tensor):
        out = _copy_tensor(value, key, kept)
    elif isinstance(value, dict):
        out = type(value)()
        for name, item in value.items():
            out[name] = host_copy(item, memo, kept=kept, key=(*key, name))
    elif type(value) in (list, tuple):
        out = type(value)(host_copy(item, memo, kept=kept, key=(*key, i)) for i, item in enumerate(value))
    else:
        out = copy.deepcopy(value)
    memo[id(value)] = out
    return out


# The background save's group, and the default group it was created for (a new default group needs a new one).
_SAVE_GROUP: tuple[Any, dist.ProcessGroup] | None = None


def _default_timeout() -> timedelta | None:
    """The default group's timeout when it is gloo (the background group times out alike); else torch's default."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None


def save_group() -> dist.ProcessGroup:
    """The gloo group of background saves, over every rank; a collective on the default group the first time.

    Created once per default group and used by nothing but background saves. See [Note: background saves].
    """
    global _SAVE_GROUP
    world = dist.group.WORLD
    if _SAVE_GROUP is None or _SAVE_GROUP[0] is not world:
        group = dist.new_group(backend="gloo", timeout=_default_timeout())
        if group is None:
            raise AssertionError(f"[rank {dist.get_rank()}] new_group returned None for a group of every rank")
        _SAVE_GROUP = (world, group)
    return _SAVE_GROUP[1]


class _Save:
    """One background save: its thread and, once it ended, its failure."""

    def __init__(self, work: Callable[[], object], where: str) -> None:
        self.where = where
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="fullshard-background-save")

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as exc:  # kept for the next wait(): nothing else would see it
            self.error = exc


_PENDING: _Save | None = None
_LOCK = threading.Lock()


def pending() -> bool:
    """Whether a background save was started and not yet waited for."""
    return _PENDING is not None


def start(work: Callable[[], object], where: str) -> None:
    """Run ``work`` (the rest of a save) in a new thread. The previous background save must have been waited for."""
    global _PENDING
    with _LOCK:
        if _PENDING is not None:
            raise AssertionError(f"{where}: a background save is still pending; wait() for it first")
        _PENDING = _Save(work, where)
        _PENDING.thread.start()


def wait() -> None:
    """Block until the background save (if any) has ended; raise its failure as :class:`BackgroundSaveError`."""
    global _PENDING
    with _LOCK:
        save, _PENDING = _PENDING, None
    if save is None:
        return
    save.thread.join()
    if save.error is not None:
        raise BackgroundSaveError(
            f"{save.error} (raised here because that save ran in the background: {save.where}; the next "
            "save_state, load_state or end_training raises a background save's failure)"
        ) from save.error


@atexit.register
def _report_at_exit() -> None:
    # Non-daemon threads are joined before atexit handlers run, so the save has ended by now.
    try:
        wait()
    except BackgroundSaveError as exc:
        print(f"fullshard: a background save failed and no call waited for it: {exc}", file=sys.stderr)
    _BUFFERS.begin()
    _BUFFERS.finish()  # the kept host buffers (pinned ones before CUDA is torn down)
