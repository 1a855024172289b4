"""``python -m fullshard.cli.worker SCRIPT ARGS…`` (or ``-m MODULE ARGS…``): one rank of ``fullshard launch``.

``fullshard launch`` starts every worker through this module rather than the script itself, so that a
failure is recorded the way torch's elastic agent reads it: an exception is written to the rank's error
file (``TORCHELASTIC_ERROR_FILE``, torch's format, plus the exact time and the rank under ``"fullshard"``,
which lets the launcher tell the first failure from the ones it caused; written whole, by a rename, so that a
worker killed while writing it leaves no file rather than half of one), then printed once to stderr under a
line naming the rank, and the worker exits 1. ``sys.exit(code)`` keeps its code; a signal keeps its
default action (the launcher reports it). The worker's state (``running``, then its exit code) goes to
``FULLSHARD_STATUS_DIR`` when the launcher sets it, the only way the launcher learns how workers ended after
it forwarded a signal (torch's agent does not report it). The script runs as ``__main__`` with ``sys.argv`` = its own
arguments, as under ``python SCRIPT``.

A worker ends with its launcher (Linux): torch starts each worker in a session of its own, so a launcher killed
by SIGKILL (a lost machine, ``kill -9`` of its process group) would leave its workers running, still in the process
group with the other machines' ranks, hiding the loss from them and from the elastic agents; the worker asks the
kernel for SIGKILL when its parent, the launcher (``FULLSHARD_LAUNCHER_PID``), ends (``PR_SET_PDEATHSIG``).

A traceback that another rank of this machine already printed (the same error raised the same way on every
rank, such as a misspelt class name) is not printed again: the rank prints one line naming the rank that
printed it (see :func:`_printed_by`).

[Note: ending a worker] After the script, the worker ends the way a forked ``multiprocessing`` child does:
it joins the script's non-daemon threads, runs the ``atexit`` handlers, flushes stdout/stderr and calls
``os._exit`` -- it skips the interpreter's own teardown. Why: torch's collective threads (gloo's workers)
may still be dropping the last reference to a finished collective's tensors when the script returns (a
barrier keeps the collectives before it alive until the barrier itself is freed, on the worker thread).
Dropping a tensor that Python has seen takes the GIL; a thread that asks for the GIL while the interpreter
is finalizing is ended by CPython mid-destructor, and the C++ runtime aborts the process ("terminate
called without an active exception", SIGABRT) after the script has finished and reported success. It was
seen about once in 60 runs of a 2-rank script ending in ``gather`` + ``end_training``. Without the
teardown there is no finalizing interpreter to meet, whatever torch's threads still hold. What is given
up: ``__del__`` of objects still alive at exit, which Python does not promise to run either. The launcher ends
the same way (``shutdown.exit_without_teardown``), for another reason: see [Note: ending the launcher] there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from fullshard.cli import as_accelerate
from fullshard.cli.failures import LAUNCHER_PID_VAR, STATUS_DIR_VAR, write_identity, write_status
from fullshard.cli.shutdown import exit_without_teardown
from fullshard.ranks import peer_lost

__all__ = ["main"]


class _RankErrorHandler(ErrorHandler):
    """torch's error file, with the script's frames only, the failure's exact time (torch keeps whole
    seconds) and the rank."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        message = {"message": f"{type(e).__name__}: {e}", "extraInfo": {"py_callstack": _script_traceback(e)}}
        message["extraInfo"]["timestamp"] = str(int(time.time()))
        data = {"message": message, "fullshard": {"time": time.time(), "rank": _rank()}}
        write_whole(path, json.dumps(data))


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees no file or the whole file, never a part: the launcher
    reads the error file when it notices the worker ended, and the worker may be killed (SIGTERM from the
    launcher stopping a failed job, SIGKILL) in the middle of writing it."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as fp:
        fp.write(text)
    os.replace(partial, path)


def _script_traceback(exc: BaseException) -> str:
    """The traceback from the script's first frame on (this module's and runpy's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>") or "runpy" in
                              tb.tb_frame.f_code.co_filename):  # fmt: skip
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _peer_lost_line(exc: BaseException) -> str:
    """What a rank whose collective failed because a peer went away says, in one line, without its rank prefix."""
    detail = str(exc).splitlines()[0]
    prefix = f"[rank {_rank()}] "
    if detail.startswith(prefix) and "a peer process ended" in detail:  # the engine's PeerLostError says it
        return detail[len(prefix) :]
    return f"a peer process ended or its connection was lost ({detail})"


def _printed_by(report: str) -> int | None:
    """The rank of this machine that already printed ``report``, or ``None`` after claiming it for this rank.

    The claim is a file named after the report's hash in the launcher's status folder, made by ``os.link`` (which
    fails if the name exists), so two ranks failing at once cannot both print. Without the folder: ``None``.
    """
    folder = os.environ.get(STATUS_DIR_VAR)
    if not folder:
        return None
    claim = os.path.join(folder, "printed-" + hashlib.sha256(report.encode()).hexdigest()[:16])
    mine = f"{claim}.{_rank()}"
    try:
        with open(mine, "w") as fp:
            fp.write(str(_rank()))
        try:
            os.link(mine, claim)
        except FileExistsError:
            with open(claim) as fp:
                return int(fp.read())
        finally:
            os.unlink(mine)
    except (OSError, ValueError):  # the folder is gone or unreadable: print, as without a launcher
        return None
    return None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _announce_restart() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt and os.environ.get("LOCAL_RANK", "0") == "0":
        total = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        sys.stderr.write(f"fullshard launch: restart {attempt} of {total}: the workers start again\n")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m fullshard.cli.worker SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    target, sys.argv = args[0], list(args)
    end_with_launcher()
    if as_accelerate.requested():  # `import accelerate` resolves to fullshard (fullshard launch --as_accelerate)
        as_accelerate.install()
    _announce_restart()
    write_identity()  # pid and rank, for the launcher's shutdown watch (cli/shutdown.py)
    write_status("running")  # stays so if a signal ends the process: the launcher reads "killed"
    code = _run(target, as_module)
    write_status(str(code))
    exit_without_teardown(code)  # see [Note: ending a worker]


def end_with_launcher() -> None:
    """Be killed (SIGKILL) when the launcher that started this worker ends, on Linux; at once if it already has."""
    launcher = os.environ.get(LAUNCHER_PID_VAR, "")
    if not sys.platform.startswith("linux") or not launcher.isdigit():
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != int(launcher):  # it ended before the request: the kernel will not send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def _run(target: str, as_module: bool) -> int:
    """Run the script; its exit code (an exception is recorded, printed under the rank's name, and gives 1)."""
    handler = _RankErrorHandler()
    handler.initialize()
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` sets it
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        sys.stderr.write(f"{stop.code}\n")
        return 1
    except Exception as exc:
        handler.record_exception(exc)
        if peer_lost(exc):  # one line, so that the first failure's traceback is not buried under these
            sys.stderr.write(f"[rank {_rank()}] stopped: {_peer_lost_line(exc)}\n")
        elif (first := _printed_by(_script_traceback(exc))) is not None:
            sys.stderr.write(f"[rank {_rank()}] {type(exc).__name__}: the same error and traceback as rank {first}\n")
        else:
            sys.stderr.write(f"[rank {_rank()}] {type(exc).__name__} in {target}:\n{_script_traceback(exc)}")
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    main()
