"""``LaunchConfig`` → the arguments and environment of torch's elastic launcher, then the launch itself.

:func:`build_launch` is pure: it returns the ``torch.distributed.run`` argument list and the variables to
add to the workers' environment, so that every combination (one machine, several with a static or a c10d
rendezvous, restarts) is tested without starting a process. :func:`run_launch` starts them.

Rendezvous:

- one machine, no port: ``--standalone`` (torch picks a free port, so launches side by side never collide);
- one machine with ``main_process_port``: a static rendezvous on ``main_process_ip`` (default 127.0.0.1);
- several machines, ``rdzv_backend: static``: ``--node_rank machine_rank --master_addr/--master_port``;
- several machines, ``rdzv_backend: c10d``: ``--rdzv_endpoint ip:port``; machine 0 hosts the store
  (``--rdzv_conf is_host=true``), so that the roles do not depend on which machine starts first. The
  rendezvous numbers the machines in the order they join, so ``RANK`` need not follow ``machine_rank``.
- an elastic range (``min_machines``, torchrun's ``--nnodes MIN:MAX``): c10d only, ``--nnodes MIN:MAX``; no
  ``is_host`` entry (machine ranks mean nothing there): as under torchrun, the first launcher on the endpoint's
  host hosts the store and the others connect to it. The job starts once ``MIN`` machines joined (after
  torch's ``last_call_timeout`` for more) and, when one is lost, its workers fail, the agents left restart theirs
  (``--max_restarts``) and meet again without it. The store lives in the hosting launcher: losing that one ends
  the job.

Every worker runs through :mod:`fullshard.cli.worker` (``--module fullshard.cli.worker SCRIPT ARGS``), which
records a failure in torch's error file and names the rank; :func:`run_launch` turns torch's report into one
summary (see [Note: root cause] in ``failures.py``) and a shell-style exit code. torch's own log lines
(including the ``OMP_NUM_THREADS`` banner: the variable is set to 1 quietly, as torchrun would) are shown
only with ``--debug``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from fullshard.cli import failures, shutdown
from fullshard.cli.config_file import LaunchConfig, did_you_mean
from fullshard.frontend import env

__all__ = [
    "DEFAULT_PORT",
    "WORKER_MODULE",
    "LaunchPlan",
    "build_launch",
    "launch_env",
    "parallelism_env",
    "run_launch",
    "torchrun_argv",
]

WORKER_MODULE = "fullshard.cli.worker"

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    """A launch, ready to run."""

    argv: list[str]
    """Arguments for ``torch.distributed.run``, ending with the worker module, the script and its arguments."""
    env: dict[str, str]
    """Variables added to the environment the workers inherit."""
    local_world_size: int = 1
    """Workers this launcher starts (on this machine)."""
    verbose: bool = False
    """Show torch's launcher log lines (``--debug``)."""
    log_dir: str | None = None
    """Where torch keeps each rank's output, if asked."""
    shutdown_timeout: int | None = None
    """Seconds from a failure (or a signal to the launcher) to SIGKILL of the workers still alive."""


def build_launch(
    cfg: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    module: bool = False,
    log_dir: str | None = None,
    shutdown_timeout: int | None = None,
    rdzv_id: str | None = None,
    rdzv_conf: str | None = None,
) -> LaunchPlan:
    """The torchrun arguments and the worker environment for ``cfg`` (no side effects)."""
    options = WorkerOptions(module, log_dir, shutdown_timeout, rdzv_id, rdzv_conf)
    argv = torchrun_argv(cfg, script, script_args, options)
    local = cfg.num_processes // cfg.num_machines
    return LaunchPlan(
        argv=argv,
        env=launch_env(cfg),
        local_world_size=local,
        verbose=bool(cfg.debug),
        log_dir=log_dir,
        shutdown_timeout=shutdown_timeout,
    )


@dataclass(frozen=True)
class WorkerOptions:
    """How the workers are started, beyond the config: ``module`` (run SCRIPT as ``python -m``); ``log_dir`` keeps
    each rank's stdout and stderr in ``log_dir/<run>/attempt_<n>/<local rank>/`` and on the console;
    ``shutdown_timeout`` is the grace period (seconds) between SIGTERM and SIGKILL when workers stop; ``rdzv_id``
    and ``rdzv_conf`` (``KEY=VALUE,...``) go to torch's launcher as they are, except that on several machines with
    c10d the ``is_host`` entry is fullshard's unless ``rdzv_conf`` sets it."""

    module: bool = False
    log_dir: str | None = None
    shutdown_timeout: int | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None


def torchrun_argv(
    cfg: LaunchConfig, script: str, script_args: Sequence[str] = (), options: WorkerOptions = WorkerOptions()
) -> list[str]:
    """``torch.distributed.run`` arguments: processes per machine, rendezvous, restarts, logs, then the worker."""
    if cfg.num_processes % cfg.num_machines:
        raise ValueError(
            f"num_processes={cfg.num_processes} with num_machines={cfg.num_machines}: num_processes counts the "
            "processes of all machines and must be a multiple of num_machines. Give the total, e.g. "
            f"--num_processes {cfg.num_machines * max(1, cfg.num_processes // cfg.num_machines)}."
        )
    per_node = str(cfg.num_processes // cfg.num_machines)
    o = options
    nnodes = f"{cfg.min_machines}:{cfg.num_machines}" if _elastic(cfg) else str(cfg.num_machines)
    argv = ["--nnodes", nnodes, "--nproc_per_node", per_node, *_rendezvous_args(cfg, o.rdzv_conf)]
    if o.rdzv_id:
        argv += ["--rdzv_id", o.rdzv_id]
    argv += ["--max_restarts", str(cfg.max_restarts)]
    if o.log_dir:
        argv += ["--log_dir", o.log_dir, "--tee", "3"]
    if o.shutdown_timeout is not None:
        argv += ["--shutdown_timeout", str(o.shutdown_timeout)]
    return [*argv, "--module", WORKER_MODULE, *(["-m"] if o.module else []), script, *script_args]


def _elastic(cfg: LaunchConfig) -> bool:
    return cfg.min_machines is not None and cfg.min_machines < cfg.num_machines


def _rendezvous_args(cfg: LaunchConfig, conf: str | None = None) -> list[str]:
    given = ["--rdzv_conf", conf] if conf else []
    port = cfg.main_process_port
    if _elastic(cfg):
        return _elastic_rendezvous_args(cfg, given)
    if cfg.num_machines == 1:
        if not port:  # None or 0: let torch find a free port
            return ["--standalone", *given]
        return [
            "--rdzv_backend",
            "static",
            "--master_addr",
            cfg.main_process_ip or "127.0.0.1",
            "--master_port",
            str(port),
            *given,
        ]
    if not cfg.main_process_ip:
        raise ValueError(
            f"num_machines={cfg.num_machines} without main_process_ip: every machine must know where machine 0 "
            "is. Pass --main_process_ip ADDRESS (and --main_process_port PORT) or set them in the config file."
        )
    port = port or DEFAULT_PORT
    if cfg.rdzv_backend == "static":
        addr = ["--master_addr", cfg.main_process_ip, "--master_port", str(port)]
        return ["--node_rank", str(cfg.machine_rank), "--rdzv_backend", "static", *addr, *given]
    is_host = "true" if cfg.machine_rank == 0 else "false"
    endpoint = f"{cfg.main_process_ip}:{port}"
    entries = [item for item in (conf or "").split(",") if item.strip()]
    if not any(item.split("=")[0].strip() == "is_host" for item in entries):
        entries.insert(0, f"is_host={is_host}")
    return ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_conf", ",".join(entries)]


def _elastic_rendezvous_args(cfg: LaunchConfig, given: list[str]) -> list[str]:
    nnodes = f"--nnodes {cfg.min_machines}:{cfg.num_machines}"
    if cfg.rdzv_backend != "c10d":
        raise ValueError(
            f"{nnodes} with rdzv_backend={cfg.rdzv_backend!r}: an elastic range needs the c10d rendezvous, where "
            "machines join and leave. Add --rdzv_backend c10d --rdzv_endpoint HOST:PORT."
        )
    if not cfg.main_process_ip:
        raise ValueError(
            f"{nnodes} without an endpoint: every launcher must know where the rendezvous store is. Pass "
            "--rdzv_endpoint HOST:PORT (the same on every machine)."
        )
    endpoint = f"{cfg.main_process_ip}:{cfg.main_process_port or DEFAULT_PORT}"
    return ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, *given]


def launch_env(cfg: LaunchConfig) -> dict[str, str]:
    """``ACCELERATE_*`` launch variables, the ``FSDP_*`` variables of ``cfg.fsdp_config`` when FSDP is on
    (``FSDP_VERSION`` always: :data:`env.DEFAULT_FSDP_VERSION` when the config gives none, as the plugin would),
    the ``ACCELERATE_DYNAMO_*`` variables of the settings ``cfg.dynamo_config`` has (FSDP or not), and the
    ``PARALLELISM_CONFIG_*`` ones of a ``parallelism_config`` section (:func:`parallelism_env`)."""
    launch = {"use_fsdp": cfg.use_fsdp, "mixed_precision": cfg.mixed_precision, "use_cpu": cfg.use_cpu}
    variables = env.format_env({**launch, "debug": cfg.debug or None}, env.LAUNCH_VARS)
    if cfg.use_fsdp:
        fsdp = {"fsdp_version": env.DEFAULT_FSDP_VERSION, **_fsdp_settings(cfg.fsdp_config)}
        variables.update(env.format_env(fsdp))
    variables.update(env.format_env(cfg.dynamo_config, env.DYNAMO_VARS))
    variables.update(parallelism_env(cfg))
    return variables


def parallelism_env(cfg: LaunchConfig) -> dict[str, str]:
    """The ``PARALLELISM_CONFIG_*`` variables (and ``ACCELERATE_USE_PARALLELISM_CONFIG=true``) of the config file's
    ``parallelism_config`` section, kept in ``cfg.extra``; ``{}`` when it is absent or empty (as Accelerate).

    Keys are Accelerate's (``parallelism_config_dp_shard_size``, ...; the prefix may be left out). Raises
    ``ValueError`` for an unknown key or value, for sizes whose product is not ``num_processes``, and for FSDP
    version 1 (a ParallelismConfig shards with ``fully_shard``).
    """
    section = cfg.extra.get("parallelism_config")
    if not section:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"parallelism_config={section!r}: expected a mapping of parallelism_config_* keys to values.")
    keys = {var.config_key: var for var in env.PARALLELISM_VARS[1:]}
    values: dict[str, object] = {"use_parallelism_config": True}
    for key, value in section.items():
        var = keys.get(str(key)) or keys.get(f"parallelism_config_{key}")
        if var is None:
            raise ValueError(
                f"parallelism_config has an unknown key {key!r}{did_you_mean([str(key)], keys)}. Use one of: "
                f"{', '.join(keys)}."
            )
        if value is not None:
            values[var.field] = var.parse(value, where=f"parallelism_config.{var.config_key}")
    sizes = [int(values.get(f"{dim}_size", 1)) for dim in ("dp_replicate", "dp_shard", "tp", "cp", "sp")]  # type: ignore[call-overload]
    total = sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4]
    if total > 1 and total != cfg.num_processes:
        raise ValueError(
            f"parallelism_config sizes {dict(zip(('dp_replicate', 'dp_shard', 'tp', 'cp', 'sp'), sizes))} multiply to "
            f"{total}, but num_processes is {cfg.num_processes}. Make them agree."
        )
    if cfg.use_fsdp and cfg.fsdp_config.get("fsdp_version", env.DEFAULT_FSDP_VERSION) != 2:
        raise ValueError(
            "parallelism_config with FSDP version 1: a ParallelismConfig shards with fully_shard, as in Accelerate. "
            "Set fsdp_version: 2 in fsdp_config (or pass --fsdp_version 2)."
        )
    return env.format_env(values, env.PARALLELISM_VARS)


def _fsdp_settings(fsdp: dict[str, object]) -> dict[str, object]:
    """``cpu_ram_efficient_loading`` needs ``sync_module_states`` (only rank 0 holds the weights)."""
    if fsdp.get("cpu_ram_efficient_loading") and fsdp.get("sync_module_states") is False:
        raise ValueError(
            "fsdp_cpu_ram_efficient_loading=true with fsdp_sync_module_states=false: only rank 0 loads the weights, "
            "so the other ranks need them broadcast. Set fsdp_sync_module_states to true (or leave it out)."
        )
    if fsdp.get("cpu_ram_efficient_loading"):
        return {**fsdp, "sync_module_states": True}
    return dict(fsdp)


def run_launch(plan: LaunchPlan) -> int:
    """Start the workers through ``torch.distributed.run``, wait, print the outcome; return the exit code.

    0 when all workers succeed; else see ``failures.py``. After a failure, the workers still alive
    ``plan.shutdown_timeout`` seconds later are killed (see [Note: shutdown after a failure] in
    ``shutdown.py``). ``plan.env`` (and ``OMP_NUM_THREADS=1`` unless set)
    is added to this process's environment for the duration (see :func:`env.patched`).
    """
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="fullshard-status-") as status_dir:
        variables = {**quiet, **plan.env, failures.STATUS_DIR_VAR: status_dir}
        variables[failures.LAUNCHER_PID_VAR] = str(os.getpid())  # the workers end with this process (worker.py)
        try:
            watch = shutdown.watching(status_dir, plan.local_world_size, plan.shutdown_timeout)
            agent = failures.readable_error_files()  # see [Note: an unreadable error file] in failures.py
            grace = shutdown.survivors_grace(plan.shutdown_timeout)  # [Note: the survivors' last words]
            timers = shutdown.rendezvous_timers_stop_on_their_thread()  # see the note there
            with env.patched(variables), _torch_logs(shown=plan.verbose), agent, grace, timers, watch as stragglers:
                torchrun.run(torchrun.parse_args(plan.argv))
        except ChildFailedError as exc:
            outcome = failures.describe_failures(exc.failures, plan.log_dir, stragglers.stragglers)
        except SignalException as exc:
            sig = signal.Signals(exc.sigval)
            outcome = failures.describe_stop(sig, failures.read_statuses(status_dir, plan.local_world_size))
        else:
            return 0
    print(outcome.message, file=sys.stderr, flush=True)
    return outcome.exit_code


_TORCH_LAUNCHER_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher", "torch.distributed.elastic")


@contextmanager
def _torch_logs(shown: bool) -> Iterator[None]:
    """Silence torch's launcher loggers (each sets its own level, so each is set) unless ``shown``."""
    if shown:
        yield
        return
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(_TORCH_LAUNCHER_LOGGERS)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
