"""What ``fullshard launch`` says when workers fail or are stopped, and the exit code it returns.

[Note: root cause]
When one rank fails, the others usually fail after it: the agent stops them with SIGTERM, or their next
collective raises because the peer's connection closed. torch orders failures by the whole second of its
error file, so a secondary failure can pass for the first. Here a failure whose message says a peer's
connection was lost counts as secondary, and the rest are ordered by the exact time the worker wrapper
(``worker.py``) recorded, else torch's timestamp (a killed worker leaves no file: torch stamps the whole
second it noticed, so exact and whole-second times are compared to the second, the exact one first). The
summary names that rank, how it ended (exit code or signal), its error, and where its output is.

[Note: an unreadable error file]
torch's agent reads a failed worker's error file when it notices the exit, and raises out of the launcher
itself (``ProcessFailure.__post_init__``: ``json.decoder.JSONDecodeError``) when the file is not whole JSON,
so the job neither restarts nor reports. The worker writes the file by a rename (``worker.write_whole``), but a
script may write it another way; so while torch's launcher runs, :func:`readable_error_files` has the agent
build its failures with :class:`_ReadableFailure`, which takes an unreadable file for no file (the worker
"failed without a message", by its exit code or signal) and keeps why under ``"fullshard"`` for the summary.

Exit codes follow the shell's convention: the first failure's exit code, or ``128 + signal`` when it was
killed by a signal; after SIGTERM to the launcher, 0 if every worker stopped cleanly, else ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from fullshard.ranks import peer_lost

__all__ = [
    "Outcome",
    "Straggler",
    "describe_failures",
    "describe_stop",
    "exit_code_of",
    "read_identities",
    "read_statuses",
    "readable_error_files",
    "write_identity",
    "write_status",
]

STATUS_DIR_VAR = "FULLSHARD_STATUS_DIR"
LAUNCHER_PID_VAR = "FULLSHARD_LAUNCHER_PID"
"""The launcher's pid, for its workers: they end with it (see ``worker.end_with_launcher``)."""


@dataclass(frozen=True)
class Straggler:
    """A worker still running when the first failure happened (seen by ``shutdown.ShutdownWatch``)."""

    rank: int
    local_rank: int
    pid: int
    state: str
    """Its process state then, in words (``stopped (SIGSTOP)``, ``running``, ``sleeping`` ...)."""
    killed: bool = False
    """The launcher ended it with SIGKILL after ``--shutdown_timeout``."""


@dataclass(frozen=True)
class Outcome:
    """The launcher's last words and its exit code."""

    message: str
    exit_code: int


@contextlib.contextmanager
def readable_error_files() -> Iterator[None]:
    """While open, torch's agent takes a worker's unreadable error file for none; see [Note: an unreadable error
    file]."""
    from torch.distributed.elastic.multiprocessing import api

    agent_class = api.ProcessFailure
    api.ProcessFailure = _readable_failure_class(agent_class)  # type: ignore[misc]
    try:
        yield
    finally:
        api.ProcessFailure = agent_class  # type: ignore[misc]


def _readable_failure_class(base: type) -> type:
    class _ReadableFailure(base):  # type: ignore[misc,valid-type]
        """torch's ``ProcessFailure``, built as if there were no error file when the file cannot be read."""

        def __post_init__(self) -> None:
            try:
                super().__post_init__()
            except Exception as exc:  # torch re-raises whatever reading the file raised
                unreadable = self.error_file
                self.error_file = os.devnull  # not a regular file: torch takes it for a missing one
                super().__post_init__()
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                self.error_file_data = {**self.error_file_data, "fullshard": {"unreadable": reason}}
                self.error_file = unreadable

    return _ReadableFailure


def exit_code_of(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: negative (killed by signal n) becomes ``128 + n``."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


def _error(failure: object) -> tuple[str, str, float | None]:
    """(one-line error, traceback, exact time) from a ``ProcessFailure``'s error file, or empty."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", "")
    if isinstance(message, dict):
        text, stack = str(message.get("message", "")), str(message.get("extraInfo", {}).get("py_callstack", ""))
    else:
        text, stack = str(message), ""
    if text == "<NONE>":  # torch's placeholder when there is no error file
        text = ""
    exact = data.get("fullshard", {}).get("time")
    return text, stack, float(exact) if exact is not None else None


def _order_key(failure: object) -> tuple[bool, int, bool, float]:
    """Sort key: primary failures first, then by time. torch's stamp is the whole second in which the agent
    noticed the exit (after it happened), so it is compared with exact times only to the second; within that
    second a failure with its own exact time comes first: a rank the agent stopped with SIGTERM after another
    rank raised at 59.7 is stamped 59, and must not pass for the first."""
    text, _, exact = _error(failure)
    secondary = peer_lost(text)
    if exact is not None:
        return secondary, int(exact), False, exact
    noticed = int(getattr(failure, "timestamp", 0))
    return secondary, noticed, True, float(noticed)


def _log_of(local_rank: int, log_dir: str | None) -> str:
    """Where the failed rank's output is: torch writes ``log_dir/<run>/attempt_<n>/<local rank>/stderr.log``."""
    if log_dir:
        logs = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
        if logs:
            return f"its log: {logs[-1]}"
    return "its output is above (pass --log_dir DIR to keep each rank's output in a file)"


def describe_failures(
    failures: Mapping[int, object], log_dir: str | None = None, stragglers: Mapping[int, Straggler] | None = None
) -> Outcome:
    """The summary of a failed job: the first failure first (see [Note: root cause]), then the others.

    ``stragglers``: the ranks still running when the first failure happened. When that failure is a timeout,
    they are the ranks that stopped answering, and are named first.
    """
    order = sorted(failures, key=lambda rank: _order_key(failures[rank]))
    first_rank = order[0]
    first = failures[first_rank]
    exitcode = int(getattr(first, "exitcode", 1))
    text, stack, _ = _error(first)
    silent = [
        s for s in (stragglers or {}).values() if s.rank not in failures or not _error(failures[s.rank])[0]
    ]  # still running at the first failure, and no error of their own
    if "timed out" not in text.lower():
        silent = []
    if silent:
        return _describe_silent(silent, first_rank, failures, log_dir)
    same = [rank for rank in order[1:] if text and _same_failure(failures[rank], first)]
    ranks = _ranks([first_rank, *same])
    log = _log_of(getattr(first, "local_rank", 0), log_dir)
    lines = [f"fullshard launch: rank {first_rank} failed first ({_how(exitcode)}); {log}"]
    if text:
        lines.append(f"  error{f' (the same on {ranks})' if same else ''}: {text}")
    elif unreadable := (getattr(first, "error_file_data", None) or {}).get("fullshard", {}).get("unreadable"):
        lines.append(f"  it failed without a message: its error file could not be read ({unreadable})")
    if stack:
        lines += [f"  traceback of {ranks}:", *("    " + line for line in stack.rstrip().splitlines())]
    lines += _then([rank for rank in order[1:] if rank not in same], failures)
    return Outcome("\n".join(lines), exit_code_of(exitcode) or 1)


def _then(ranks: list[int], failures: Mapping[int, object]) -> list[str]:
    lines = []
    for rank in ranks:
        other_text, _, _ = _error(failures[rank])
        other = _how(int(getattr(failures[rank], "exitcode", 1))) + (f", after {other_text}" if other_text else "")
        lines.append(f"  then rank {rank} failed ({other.splitlines()[0]})")
    return lines


def _describe_silent(
    silent: list[Straggler], timed_out: int, failures: Mapping[int, object], log_dir: str | None
) -> Outcome:
    """Rank(s) that stopped answering: still running when rank ``timed_out`` gave up waiting for them."""
    first = silent[0]
    how = "killed by SIGKILL after --shutdown_timeout" if first.killed else "ended by the launcher"
    names = ", ".join(str(s.rank) for s in silent)
    lines = [
        f"fullshard launch: rank {names} stopped answering: {'it was' if len(silent) == 1 else 'they were'} still "
        f"running ({first.state}) when rank {timed_out} timed out waiting in a collective; {how}; "
        f"{_log_of(first.local_rank, log_dir)}"
    ]
    others = [rank for rank in failures if rank not in {s.rank for s in silent}]
    lines += _then(sorted(others, key=lambda rank: _order_key(failures[rank])), failures)
    return Outcome("\n".join(lines), 128 + int(signal.SIGKILL))


def _same_failure(one: object, other: object) -> bool:
    """Whether two ranks failed the same way: the same exit, error message and traceback."""
    same_exit = getattr(one, "exitcode", 1) == getattr(other, "exitcode", 1)
    return same_exit and _error(one)[:2] == _error(other)[:2]


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


# --- a stop requested by a signal to the launcher ---------------------------------------------------------


def write_status(status: str) -> None:
    """Record this worker's state (``running`` or its exit code) where the launcher reads it, if it asked."""
    folder = os.environ.get(STATUS_DIR_VAR)
    if folder:
        Path(folder, f"local_rank{os.environ.get('LOCAL_RANK', '0')}").write_text(status)


def write_identity() -> None:
    """Record this worker's pid and global rank where the launcher reads them, if it asked (before its state)."""
    folder = os.environ.get(STATUS_DIR_VAR)
    if folder:
        Path(folder, f"local_rank{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(f"{os.getpid()} {_rank()}")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def read_identities(folder: str | Path, local_world_size: int) -> dict[int, tuple[int, int]]:
    """Local rank → (pid, global rank) of the workers that recorded them."""
    identities = {}
    for local_rank in range(local_world_size):
        with contextlib.suppress(OSError, ValueError):
            pid, rank = Path(folder, f"local_rank{local_rank}.pid").read_text().split()
            identities[local_rank] = (int(pid), int(rank))
    return identities


def read_statuses(folder: str | Path, local_world_size: int) -> dict[int, str]:
    """Local rank → its last recorded state (``"missing"`` if it never wrote one)."""
    statuses = {}
    for local_rank in range(local_world_size):
        path = Path(folder, f"local_rank{local_rank}")
        statuses[local_rank] = path.read_text().strip() if path.is_file() else "missing"
    return statuses


def describe_stop(sig: signal.Signals, statuses: Mapping[int, str]) -> Outcome:
    """After ``sig`` reached the launcher (and through it the workers): 0 if all exited 0, else ``128 + sig``."""
    clean = all(status == "0" for status in statuses.values())
    if clean:
        return Outcome(
            f"fullshard launch: {sig.name} received and passed to the workers; all {len(statuses)} stopped "
            "cleanly (exit 0).",
            0,
        )
    details = ", ".join(
        f"local rank {rank} " + (f"exit code {status}" if status.lstrip("-").isdigit() else "killed")
        for rank, status in statuses.items()
        if status != "0"
    )
    return Outcome(
        f"fullshard launch: {sig.name} received and passed to the workers; not all stopped cleanly ({details}). "
        "A script stops cleanly by calling fullshard.utils.install_preemption_handler() and polling "
        "accelerator.check_trigger() each step (see docs/fault-tolerance.md).",
        128 + int(sig),
    )
