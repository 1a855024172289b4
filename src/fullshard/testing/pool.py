"""Run functions on a set of long-lived gloo worker processes.

Spawning ranks costs about two seconds each time (importing torch, building the process group), so a
test suite that spawned per test would spend most of its time starting processes. A :class:`WorkerPool`
spawns ``world_size`` ranks once and then runs any number of picklable functions on all of them.

[Note: forked from a server]
A gloo pool's ranks are forked from ``multiprocessing``'s fork server, which imported torch, DTensor and the
Accelerator once (``_PRELOAD``): a rank then starts in milliseconds of CPU instead of 2.5 s of imports (the suite
starts about 30 ranks). The server is a fresh interpreter that only imported modules (no thread, no process
group, no OpenMP pool: forking it is safe) and a rank gets the parent's environment as it is at the start, as a
spawned one would. What a fork cannot give is a fresh allocator and memory image (``VmHWM`` starts at the
server's resident size; environment variables read at exec, ``MALLOC_*``, have no effect): a pool with its own
``env``, an NCCL pool, and :func:`fullshard.testing.bench.on_fresh_ranks` spawn (``start_method="spawn"``).

Invariants:
- Every call runs ``fn(rank, world_size, *args)`` on every rank with the default process group
  initialised (gloo, CPU) and returns the per-rank results in rank order.
- If any rank raises, the call raises :class:`RankFailure` carrying that rank's traceback. Ranks that
  are left waiting in a collective are given ``grace_s`` seconds to fail too; if any is still running
  then, the pool is torn down and the next call starts a fresh one: a failing test never poisons the next.
- A call that takes longer than ``timeout_s`` tears the pool down and raises ``TimeoutError``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankFailure", "WorkerPool", "run_on_ranks"]


class RankFailure(RuntimeError):
    """A function raised on one or more ranks; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        super().__init__(f"failed on rank(s) {sorted(failures)}:\n{text}")


def _worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    conn: Connection,
    env: dict[str, str],
    pg_timeout_s: float,
    backend: str = "gloo",
) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            fn, args = message
            try:
                result = fn(rank, world_size, *args)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ("torch", "torch.distributed.tensor", "fullshard.frontend.accelerator", "fullshard.testing.pool")
"""What the fork server imports once for every gloo pool's ranks ([Note: forked from a server])."""


def _health_check(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=5))
    total = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(total)
    if int(total.item()) != world_size:
        raise RuntimeError(f"health check: all_reduce gave {total.item()}, expected {world_size}")


class WorkerPool:
    """``world_size`` gloo ranks, spawned on first use and kept for every later :meth:`run`."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 300.0,
        grace_s: float = 20.0,
        env: dict[str, str] | None = None,
        backend: str = "gloo",
        start_method: str | None = None,
    ) -> None:
        self.world_size = world_size
        # forked from the preloaded server unless a fresh interpreter is needed ([Note: forked from a server])
        self.start_method = start_method or ("forkserver" if backend == "gloo" and env is None else "spawn")
        self.backend = backend  # "nccl": one GPU per rank, rank r on device r
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(_PRELOAD))
        self._tmp = tempfile.TemporaryDirectory(prefix="fullshard-pool-")
        init_method = f"file://{self._tmp.name}/store"
        env = {**os.environ, **self.env}  # this process's environment now, as a spawned rank would have it
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            # The process-group timeout bounds a collective that a failed peer left hanging.
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_method, child, env, self.grace_s, self.backend),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        results, failures, pending = self._run_once(fn, args)
        if failures or pending:
            # Every rank returned (even with an error): the ranks stay usable if their process group
            # still works (a rank that timed out in a collective leaves it broken). A rank still
            # running is stuck, and the pool must be rebuilt.
            if pending or not self._healthy():
                self.close()
            if failures:
                raise RankFailure(failures)
            raise TimeoutError(f"ranks {sorted(pending)} did not finish {fn.__name__} in {self.timeout_s}s")
        return [results[r] for r in range(self.world_size)]

    def _healthy(self) -> bool:
        try:
            _, failures, pending = self._run_once(_health_check, (), timeout_s=self.grace_s)
        except (BrokenPipeError, EOFError, ConnectionResetError):  # a rank died: its pipe is closed
            return False
        return not failures and not pending

    def _run_once(
        self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float | None = None
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, Connection]]:
        for conn in self._conns:
            conn.send((fn, args))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            for conn in wait(list(pending.values()), timeout=deadline - now):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    status, payload = "error", f"rank {rank} exited (code {self._procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = payload
                else:
                    if not failures:
                        # Peers of a failed rank may hang in a collective: wait for them a little only.
                        deadline = min(deadline, time.monotonic() + self.grace_s)
                    failures[rank] = payload
        return results, failures, pending

    def close(self) -> None:
        """Stop every worker (politely, then by force) and forget them."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks, run ``fn(rank, world_size, *args)`` on each, and stop them."""
    pool = WorkerPool(world_size)
    try:
        return pool.run(fn, *args)
    finally:
        pool.close()
