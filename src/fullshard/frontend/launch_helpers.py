"""Helpers for scripts that start their own processes (:func:`patch_environment`, :class:`PrepareForLaunch`,
:func:`debug_launcher`) and for the process environment (``clear_environment``, ``check_os_kernel``, ...)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing

from fullshard.frontend import env
from fullshard.frontend.enums import DistributedType

__all__ = [
    "PrepareForLaunch",
    "debug_launcher",
    "check_os_kernel",
    "clear_environment",
    "convert_dict_to_env_variables",
    "patch_environment",
    "purge_accelerate_environment",
]

_logger = logging.getLogger(__name__)
_MIN_KERNEL = (5, 5, 0)


def patch_environment(**kwargs: Any) -> contextlib.AbstractContextManager[None]:
    """Set ``os.environ[KEY.upper()] = str(value)`` for the block; afterwards every key is as it was before."""
    return env.patched({key.upper(): str(value) for key, value in kwargs.items()})


class PrepareForLaunch:
    """Wraps ``launcher`` for ``torch.multiprocessing.start_processes``: process ``index`` gets its rank variables.

    For a multi-process ``distributed_type`` the call sets ``LOCAL_RANK=index`` and ``RANK = NPROC * NODE_RANK +
    index`` (``NPROC`` and ``NODE_RANK`` from the environment, default 1 and 0); the caller sets ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (e.g. with :func:`patch_environment`). ``debug`` is accepted and unused.
    """

    def __init__(self, launcher: Callable[..., Any], distributed_type: str = "NO", debug: bool = False) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(str(getattr(distributed_type, "value", distributed_type)))
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.distributed_type is not DistributedType.NO:
            nproc, node_rank = int(os.environ.get("NPROC", 1)), int(os.environ.get("NODE_RANK", 0))
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(nproc * node_rank + index)
        os.environ["FORK_LAUNCHED"] = "1"
        return self.launcher(*args)


def debug_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` in ``num_processes`` CPU processes that form a gloo process group (for testing and
    debugging, as Accelerate's ``debug_launcher``); an ``Accelerator`` built there joins it. The processes are
    forked, or spawned (``function`` must then be importable) when this process already has a process group.
    Raises when a process fails, with its traceback."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"debug_launcher(num_processes={num_processes!r}): expected an int >= 1.")
    with socket.socket() as probe:  # a free port, so that jobs on one machine do not meet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    variables = {"world_size": num_processes, "nproc": num_processes, "master_addr": "127.0.0.1",
                 "master_port": port, "accelerate_mixed_precision": "no", "accelerate_use_cpu": "yes"}  # fmt: skip
    with patch_environment(**variables):
        launcher = PrepareForLaunch(_ForgetParentGroup(function), distributed_type="MULTI_CPU", debug=True)
        # Forked children would inherit this process's group, if it has one: then start them fresh.
        method = "spawn" if torch.distributed.is_available() and torch.distributed.is_initialized() else "fork"
        torch.multiprocessing.start_processes(launcher, args=args, nprocs=num_processes, start_method=method)


class _ForgetParentGroup:
    """Runs ``function`` in a launched process after forgetting the shared Accelerator state a forked child
    inherits, so that its ``Accelerator`` joins the group of the launched processes; the group that joining made
    is destroyed once every process has returned."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        from fullshard.frontend.processes.shared_state import AcceleratorState

        AcceleratorState._reset_state(True)
        result = self.function(*args)
        # A forked child that returns with its gloo group alive can abort at exit ("terminate called without an
        # active exception": gloo's threads still joinable at teardown), so the group ends here, after every
        # process has finished the function (the barrier), never while a peer still talks to it.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        return result


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """An empty ``os.environ`` for the block; afterwards exactly the variables of before (added ones removed)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def convert_dict_to_env_variables(current_env: dict[str, str], *, logger: logging.Logger | None = None) -> list[str]:
    """``KEY=value\\n`` lines for an environment file; an empty key or value, or one holding ``; < >``, a space or
    a newline, is left out with a warning naming it (on ``logger``, by default this module's)."""
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in ";\n<> "):
            lines.append(f"{key}={value}\n")
        else:
            (logger or _logger).warning(
                f"convert_dict_to_env_variables: skipping {key}={value}: empty, or a forbidden character."
            )
    return lines


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorate a function (or every ``test*`` method of a class and its subclasses) so that ``ACCELERATE_*``
    variables it sets or changes are put back as they were when it returns."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
            try:
                return func(*args, **kwargs)
            finally:
                for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
                    del os.environ[key]
                os.environ.update(saved)

        run._accelerate_purged = True  # type: ignore[attr-defined]
        return run

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method) and not hasattr(method, "_accelerate_purged"):
                setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kw: wrap_tests(cls))  # type: ignore[misc]
    return func_or_cls


def check_os_kernel() -> None:
    """Warn (``logging``) when a Linux kernel is older than 5.5.0, which can make processes hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if found is None:
        return
    version = tuple(int(x) for x in found.groups())
    if version < _MIN_KERNEL:
        _logger.warning(
            f"Detected kernel version {found.group(0)}, which is below the recommended minimum of "
            f"{'.'.join(map(str, _MIN_KERNEL))}; this can cause the process to hang. Upgrade the kernel."
        )
