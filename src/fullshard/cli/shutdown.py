"""After a worker fails: end the others within ``--shutdown_timeout``, and note the ones that stopped answering.

[Note: shutdown after a failure]
When a worker fails, torch's elastic agent (2.13) stops the others with SIGTERM and waits for them before
SIGKILL, but on this path (``_stop_workers``, before a restart or the end) it waits a fixed 30 s: the
``shutdown_timeout`` it was given applies only when the launcher itself receives a signal. A rank that
ignores SIGTERM (stopped by SIGSTOP, blocked in a C call with a Python handler installed) therefore kept the
launch alive 30 s. :class:`ShutdownWatch` runs beside the agent in the launcher: it reads what each worker
recorded (its pid, global rank and state, see :func:`fullshard.cli.failures.write_status`), and from the first
failure on it sends SIGKILL to the process group of every worker of that attempt still alive
``shutdown_timeout`` seconds later, as the agent would after its own wait. Only the launcher's own children
are signalled.

It also remembers which ranks were still running when the first one failed. If that failure is a timeout
(a rank gave up waiting in a collective), those ranks are the ones that stopped answering, and the summary
names them first (see ``failures.describe_failures``): the agent reports only the ranks that had ended when
it looked, so without this the rank that timed out was named as the cause.

[Note: the survivors' last words]
When a worker fails, the others usually fail a moment later on their own: their next collective finds the peer
gone and each prints one line (``[rank 0] stopped: a peer process ended ...``, see ``worker.py``). torch's agent
stops them with SIGTERM as soon as its poll sees the first failure (``SubprocessContext._poll`` closes the
context), so on a busy machine the signal often won the race and a survivor ended without its line (seen in CI:
the test reading it failed). While the launcher runs, :func:`survivors_grace` has the context wait, before that
SIGTERM, up to ``SURVIVORS_GRACE_S`` (never more than ``--shutdown_timeout``) for the workers still alive to end by
themselves; only once a worker has failed (a SIGTERM to the launcher, or a restart for a node that joins, stops
healthy workers at once). A survivor that is computing, or hangs, gets SIGTERM after the grace as before; the
survivors that ended on their own are then reported with their own exit code and message.

[Note: ending the launcher]
A worker SIGKILLed without restarts: the agent notices within its monitor interval (0.1 s), stops the other
workers, and ``fullshard launch`` prints its summary about 0.3-0.5 s after the kill (measured on the loaded
2-core machine). The launcher then took another 2-4 s to exit: the interpreter's teardown (``Py_FinalizeEx``,
a garbage collection over every module the launcher imported: torch, the front end, numpy; a native stack
taken then shows nothing else running), which grew with the imports (0.7-1.1 s from kill to exit on
2026-11-25, 2.1-3.1 s on 2026-11-26). Nothing is left to do by then: the workers have ended, the summary is
printed, the status folder removed. So the ``fullshard`` command (``cli.main.main``, which owns the process;
not ``cli`` itself, which tests invoke in their own process) ends like a worker ([Note: ending a worker] in
``worker.py``): :func:`exit_without_teardown` joins the non-daemon threads, runs the ``atexit`` handlers,
flushes the streams and calls ``os._exit``.

[Note: a timer collected on its own thread]
torch's dynamic rendezvous (2.13) keeps its lease alive with a ``_PeriodicTimer``: a daemon thread calling a
function every few seconds, stopped by a ``weakref.finalize`` that sets an event and joins the thread. When the
launcher ends after a SIGTERM, the rendezvous handler and its timer become garbage; if the collection that frees
them runs on the timer's own thread (a garbage collection starts on whichever thread allocates when it is due),
the finalizer joins the current thread, and Python prints "Exception ignored in: <finalize object ...>" with a
``RuntimeError: cannot join current thread`` traceback under the launcher's summary (seen once in CI, in the test
of a SIGTERM without a handler). Nothing was wrong but the message. While the launcher runs,
:func:`rendezvous_timers_stop_on_their_thread` gives the timers it starts a stop that, on the timer's own thread,
only sets the event (the loop then ends by itself), and joins as before from any other thread.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from fullshard.cli.failures import Straggler, read_identities, read_statuses

__all__ = [
    "SURVIVORS_GRACE_S",
    "ShutdownWatch",
    "exit_without_teardown",
    "rendezvous_timers_stop_on_their_thread",
    "survivors_grace",
    "watching",
]

POLL_S = 0.2
SURVIVORS_GRACE_S = 5.0
"""The longest the agent waits for the workers left after a failure to end on their own (the module note)."""

_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "R": "running", "S": "sleeping", "D": "in disk wait"}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid``, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


@dataclass
class ShutdownWatch:
    """Polls the workers' records in ``folder`` (see the module note) until :meth:`stop`."""

    folder: str
    local_world_size: int
    shutdown_timeout: float | None
    """Seconds from the first failure to SIGKILL of the workers still alive; None: observe only."""
    stragglers: dict[int, Straggler] = field(default_factory=dict)
    """Global rank → the workers still running at the first failure (the last attempt's)."""
    _failed_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> None:
        statuses = read_statuses(self.folder, self.local_world_size)
        workers = read_identities(self.folder, self.local_world_size)  # local rank → (pid, global rank)
        alive = {}
        for local_rank, (pid, rank) in workers.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[1] == os.getpid() and stat[0] != "Z":
                alive[local_rank] = (pid, rank, stat[0])
        failed = any(
            status not in ("running", "0", "missing") or (status == "running" and local_rank not in alive)
            for local_rank, status in statuses.items()
            if local_rank in workers
        )
        if failed and self._failed_at is None:
            self._failed_at = time.monotonic()
            self.stragglers = {
                rank: Straggler(rank, local_rank, pid, _STATES.get(state, state))
                for local_rank, (pid, rank, state) in alive.items()
                if statuses.get(local_rank) == "running"
            }
        if self._failed_at is None:
            return
        suspects = {s.pid for s in self.stragglers.values()}
        left = [(pid, rank) for pid, rank, _ in alive.values() if pid in suspects]
        if not left and not failed:
            self._failed_at = None  # that attempt is over (the agent may start another)
            return
        if self.shutdown_timeout is not None and time.monotonic() - self._failed_at >= self.shutdown_timeout:
            for pid, rank in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self.stragglers[rank] = dataclasses.replace(self.stragglers[rank], killed=True)


@contextlib.contextmanager
def watching(folder: str, local_world_size: int, shutdown_timeout: float | None) -> Iterator[ShutdownWatch]:
    """A :class:`ShutdownWatch` polling in a daemon thread for the duration."""
    watch = ShutdownWatch(folder, local_world_size, shutdown_timeout)
    thread = threading.Thread(target=watch.run, name="fullshard-shutdown-watch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch.stop()
        thread.join()


@contextlib.contextmanager
def survivors_grace(shutdown_timeout: float | None) -> Iterator[None]:
    """While open, torch's agent lets the workers left after a failure end on their own before it stops them;
    see [Note: the survivors' last words]."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    grace = SURVIVORS_GRACE_S if shutdown_timeout is None else min(SURVIVORS_GRACE_S, shutdown_timeout)
    close = SubprocessContext._close

    def close_after_grace(context: SubprocessContext, *args: object, **kwargs: object) -> None:
        wait_for_survivors(context.subprocess_handlers, grace)
        close(context, *args, **kwargs)

    SubprocessContext._close = close_after_grace  # type: ignore[method-assign]
    try:
        yield
    finally:
        SubprocessContext._close = close  # type: ignore[method-assign]


@contextlib.contextmanager
def rendezvous_timers_stop_on_their_thread() -> Iterator[None]:
    """While open, a rendezvous keep-alive timer started then stops cleanly when it is collected on its own thread;
    see [Note: a timer collected on its own thread]."""
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    stop = _PeriodicTimer.__dict__["_stop_thread"]

    def stop_thread(thread: threading.Thread, stop_event: threading.Event) -> None:
        if thread is threading.current_thread():
            stop_event.set()  # its loop ends after this call; nothing to wait for
            return
        stop.__func__(thread, stop_event)

    _PeriodicTimer._stop_thread = staticmethod(stop_thread)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _PeriodicTimer._stop_thread = stop  # type: ignore[method-assign]


def wait_for_survivors(handlers: dict[int, object], grace: float) -> bool:
    """Once one of the workers (torch's ``SubprocessHandler`` s, by local rank) has failed, wait up to ``grace``
    seconds for the others to end; return whether none is left running. Nothing is waited for when none failed."""
    procs = [getattr(handler, "proc", None) for handler in handlers.values()]
    procs = [proc for proc in procs if proc is not None]
    if not any(proc.poll() not in (None, 0) for proc in procs):
        return not any(proc.poll() is None for proc in procs)
    deadline = time.monotonic() + grace
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with ``code`` after what ``sys.exit`` does while the interpreter is still whole (join the non-daemon
    threads, run the ``atexit`` handlers, flush stdout and stderr), skipping the interpreter's own teardown. See
    [Note: ending a worker] in ``worker.py`` and [Note: ending the launcher]."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter runs at exit; no public name in the standard library
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing left to save
            stream.flush()
    os._exit(code)
