"""``accelerate.test_utils.testing``: skip decorators that ask what this machine has, test cases that reset
fullshard's shared state, and subprocess helpers whose launch command is ``fullshard launch --as_accelerate``.

Every ``require_*`` decision is the one Accelerate makes on the same machine, except those that ask for FP8
(fullshard refuses ``mixed_precision="fp8"``, so ``require_fp8`` skips) and for a transformer engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import fullshard.accelerate
from fullshard.accelerate.state import AcceleratorState
from fullshard.frontend.availability import (
    is_aim_available,
    is_clearml_available,
    is_comet_ml_available,
    is_cuda_available,
    is_datasets_available,
    is_dvclive_available,
    is_fp8_available,
    is_fp16_available,
    is_hpu_available,
    is_matplotlib_available,
    is_mlflow_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_pandas_available,
    is_pytest_available,
    is_schedulefree_available,
    is_sdaa_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_torchao_available,
    is_torchdata_stateful_dataloader_available,
    is_trackio_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)
from fullshard.frontend.ops import gather
from fullshard.frontend.versions import is_torch_version

__all__ = [
    "DEFAULT_LAUNCH_COMMAND",
    "AccelerateTestCase",
    "MockingTestCase",
    "SubprocessCallException",
    "TempDirTestCase",
    "are_the_same_tensors",
    "assert_exception",
    "capture_call_output",
    "device_count",
    "execute_subprocess_async",
    "get_launch_command",
    "get_torch_dist_unique_port",
    "memory_allocated_func",
    "parse_flag_from_env",
    "path_in_accelerate_package",
    "pytest_xdist_worker_id",
    "run_command",
    "run_first",
    "skip",
    "slow",
    "torch_device",
]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _backend() -> tuple[str, int, Callable[[], int]]:
    """(device type, device count, memory-allocated function) of this process's accelerator, else the CPU's."""
    for name in ("cuda", "xpu", "npu", "mlu", "musa", "sdaa", "hpu"):
        module = getattr(torch, name, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return name, module.device_count(), module.memory_allocated
    if is_mps_available():
        return "mps", 1, torch.mps.current_allocated_memory
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = _backend()


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The environment variable ``key`` read as a yes/no flag; a value that is neither raises, naming it."""
    value = os.environ.get(key)
    if value is None:
        return default
    if value.strip().lower() in ("1", "true", "yes", "y", "on", "t"):
        return True
    if value.strip().lower() in ("0", "false", "no", "n", "off", "f", ""):
        return False
    raise ValueError(f"{key}={value!r} is not a yes/no flag; use 1 or 0.")


_run_slow_tests = parse_flag_from_env("RUN_SLOW")


def get_launch_command(**kwargs: Any) -> list[str]:
    """``fullshard launch --as_accelerate`` with ``--key=value`` per keyword (``--key`` for ``True``)."""
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--as_accelerate"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None and value is not False:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count)


def _skip_unless(condition: bool, reason: str) -> Callable[[Any], Any]:
    return unittest.skipUnless(condition, reason)


def skip(test_case: Any) -> Any:
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case: Any) -> Any:
    """Runs only with ``RUN_SLOW=1``."""
    return _skip_unless(_run_slow_tests, "test is slow (set RUN_SLOW=1)")(test_case)


def _cuda() -> bool:
    return is_cuda_available() and not is_torch_xla_available()


_CONDITIONS: dict[str, tuple[Callable[[], bool], str]] = {
    "require_cpu": (lambda: torch_device == "cpu", "test requires only a CPU"),
    "require_non_cpu": (lambda: torch_device != "cpu", "test requires an accelerator"),
    "require_cuda": (_cuda, "test requires a GPU"),
    "require_cuda_or_hpu": (lambda: _cuda() or is_hpu_available(), "test requires a GPU or HPU"),
    "require_xpu": (is_xpu_available, "test requires an XPU"),
    "require_cuda_or_xpu": (lambda: _cuda() or is_xpu_available(), "test requires a CUDA GPU or XPU"),
    "require_non_xpu": (lambda: torch_device != "xpu", "test requires a non-XPU"),
    "require_non_hpu": (lambda: torch_device != "hpu", "test requires a non-HPU"),
    "require_fp16": (is_fp16_available, "test requires FP16 support"),
    "require_fp8": (is_fp8_available, "test requires FP8 support (fullshard refuses fp8)"),
    "require_fsdp2": (lambda: is_torch_version(">=", "2.5.0"), "test requires FSDP2"),
    "require_mlu": (is_mlu_available, "test requires an MLU"),
    "require_sdaa": (is_sdaa_available, "test requires an SDAA"),
    "require_musa": (is_musa_available, "test requires a MUSA"),
    "require_npu": (is_npu_available, "test requires an NPU"),
    "require_neuron": (lambda: False, "test requires a Neuron device"),
    "require_mps": (is_mps_available, "test requires MPS"),
    "require_huggingface_suite": (
        lambda: is_transformers_available() and is_datasets_available(),
        "test requires transformers and datasets",
    ),
    "require_datasets": (is_datasets_available, "test requires datasets"),
    "require_transformers": (is_transformers_available, "test requires transformers"),
    "require_timm": (lambda: _installed("timm"), "test requires timm"),
    "require_torchvision": (lambda: _installed("torchvision"), "test requires torchvision"),
    "require_triton": (lambda: _installed("triton"), "test requires triton"),
    "require_schedulefree": (is_schedulefree_available, "test requires schedulefree"),
    "require_bnb": (lambda: _installed("bitsandbytes"), "test requires bitsandbytes"),
    "require_tpu": (is_torch_xla_available, "test requires a TPU"),
    "require_non_torch_xla": (lambda: not is_torch_xla_available(), "test requires an env without torch_xla"),
    "require_single_device": (
        lambda: torch_device != "cpu" and device_count == 1,
        "test requires a single accelerator device",
    ),
    "require_single_gpu": (lambda: torch.cuda.device_count() == 1, "test requires one GPU"),
    "require_single_xpu": (lambda: is_xpu_available() and torch.xpu.device_count() == 1, "test requires one XPU"),
    "require_multi_device": (lambda: device_count > 1, "test requires several accelerator devices"),
    "require_multi_gpu": (lambda: torch.cuda.device_count() > 1, "test requires several GPUs"),
    "require_multi_xpu": (lambda: is_xpu_available() and torch.xpu.device_count() > 1, "test requires several XPUs"),
    "require_multi_gpu_or_xpu": (lambda: device_count > 1 and torch_device in ("cuda", "xpu"), "test requires GPUs"),
    "require_deepspeed": (lambda: False, "test requires DeepSpeed (fullshard has none)"),
    "require_tp": (lambda: False, "test requires Accelerate's tensor-parallel path"),
    "require_tensorboard": (is_tensorboard_available, "test requires tensorboard"),
    "require_wandb": (is_wandb_available, "test requires wandb"),
    "require_trackio": (is_trackio_available, "test requires trackio"),
    "require_comet_ml": (is_comet_ml_available, "test requires comet_ml"),
    "require_aim": (is_aim_available, "test requires aim"),
    "require_clearml": (is_clearml_available, "test requires clearml"),
    "require_dvclive": (is_dvclive_available, "test requires dvclive"),
    "require_swanlab": (is_swanlab_available, "test requires swanlab"),
    "require_pandas": (is_pandas_available, "test requires pandas"),
    "require_mlflow": (is_mlflow_available, "test requires mlflow"),
    "require_matplotlib": (is_matplotlib_available, "test requires matplotlib"),
    "require_pippy": (lambda: _installed("pippy"), "test requires pippy"),
    "require_import_timer": (lambda: _installed("import_timer"), "test requires import_timer"),
    "require_transformer_engine": (lambda: _installed("transformer_engine"), "test requires transformer_engine"),
    "require_transformer_engine_mxfp8": (lambda: False, "test requires transformer_engine with MXFP8"),
    "require_torchao": (is_torchao_available, "test requires torchao"),
    "require_torchdata_stateful_dataloader": (
        is_torchdata_stateful_dataloader_available,
        "test requires torchdata.stateful_dataloader",
    ),
    "require_trackers": (
        lambda: is_tensorboard_available() or is_wandb_available() or is_comet_ml_available(),
        "test requires a tracker package",
    ),
}


def _decorator(name: str, condition: Callable[[], bool], reason: str) -> Callable[[Any], Any]:
    def decorate(test_case: Any) -> Any:
        return _skip_unless(condition(), reason)(test_case)

    decorate.__name__ = decorate.__qualname__ = name
    decorate.__doc__ = f"Skips the test unless: {reason.removeprefix('test requires ')}."
    return decorate


for _name, (_condition, _reason) in _CONDITIONS.items():
    globals()[_name] = _decorator(_name, _condition, _reason)
__all__ += list(_CONDITIONS)


def require_torch_min_version(test_case: Any = None, version: str | None = None) -> Any:
    """Skips the test unless torch is at least ``version``; usable with or without the test."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return _skip_unless(is_torch_version(">=", str(version)), f"test requires torch >= {version}")(test_case)


__all__.append("require_torch_min_version")


def run_first(test_case: Any) -> Any:
    """Marks the test ``order(1)`` for the pytest-order plugin (a no-op mark without it)."""
    if is_pytest_available():
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


class TempDirTestCase(unittest.TestCase):
    """One temporary folder ``self.tmpdir`` for the whole class, emptied before each test (``clear_on_setup``)."""

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in self.tmpdir.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """Forgets the shared Accelerator state (and the process state) after every test."""

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)


class MockingTestCase(unittest.TestCase):
    """``self.add_mocks(m)`` in ``setUp`` starts the mocks for this test and stops them at its end."""

    def add_mocks(self, mocks: Any | list[Any]) -> None:
        self.mocks = list(mocks) if isinstance(mocks, (list, tuple)) else [mocks]
        for one in self.mocks:
            one.start()
            self.addCleanup(one.stop)


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds the same ``tensor``."""
    local = tensor[None].clone().to(AcceleratorState().device)
    everyone = gather(local).cpu()
    return all(torch.equal(row, local[0].cpu()) for row in everyone)


class _RunOutput:
    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class SubprocessCallException(Exception):
    pass


async def _stream(stream: asyncio.StreamReader, sink: list[str], echo: Any) -> None:
    while line := await stream.readline():
        text = line.decode("utf-8").rstrip()
        sink.append(text)
        if echo is not None:
            print(text, file=echo)


async def _run(cmd: list[str], env: Any, stdin: Any, timeout: float, quiet: bool) -> _RunOutput:
    process = await asyncio.create_subprocess_exec(
        cmd[0], *cmd[1:], stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out: list[str] = []
    err: list[str] = []
    streams = [_stream(process.stdout, out, None if quiet else sys.stdout),  # type: ignore[arg-type]
               _stream(process.stderr, err, None if quiet else sys.stderr)]  # type: ignore[arg-type]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*streams), timeout=timeout)
    return _RunOutput(await process.wait(), out, err)


def execute_subprocess_async(
    cmd: list[str], env: Any = None, stdin: Any = None, timeout: float = 180, quiet: bool = False, echo: bool = True
) -> _RunOutput:
    """Run ``cmd``, streaming its output; a non-zero exit raises ``RuntimeError`` with the command and stderr."""
    if echo:
        print("\nRunning:", " ".join(map(str, cmd)))
    result = asyncio.run(_run([str(c) for c in cmd], env, stdin, timeout, quiet))
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, cmd))!r} failed with returncode {result.returncode}\n\n"
            f"The combined stderr from workers follows:\n" + "\n".join(result.stderr)
        )
    return result


def run_command(command: list[str], return_stdout: bool = False, env: Any = None) -> str | None:
    """Run ``command``; its failure raises ``SubprocessCallException`` with the output."""
    try:
        output = subprocess.check_output([str(c) for c in command], stderr=subprocess.STDOUT, env=env)
    except subprocess.CalledProcessError as e:
        raise SubprocessCallException(f"{' '.join(map(str, command))!r} failed:\n\n{e.output.decode()}") from e
    return output.decode("utf-8") if return_stdout else None


def pytest_xdist_worker_id() -> int:
    """This pytest-xdist worker's number (``gw3`` -> 3), 0 without xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def get_torch_dist_unique_port() -> int:
    """A free TCP port for a process group's master."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the package that serves ``accelerate`` (``fullshard/accelerate``)."""
    return Path(fullshard.accelerate.__file__).parent.joinpath(*components)


@contextlib.contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """The block must raise ``exception_class`` (with ``msg`` in its text, if given)."""
    try:
        yield
    except Exception as e:
        assert isinstance(e, exception_class), f"Expected exception of type {exception_class} but got {type(e)}"
        assert msg is None or msg in str(e), f"Expected message '{msg}' to be in exception but got '{e}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What ``func(*args, **kwargs)`` printed to stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        func(*args, **kwargs)
    return out.getvalue()


_ = mock  # MockingTestCase's mocks are unittest.mock objects
