"""Trackers: what the files hold (read back with json and with TensorBoard's own reader), log_with's checks, and
a run killed mid-training leaving only whole JSON lines.

One process: ``Accelerator()`` without a launcher is a process group of one rank. The rank-0-only rule is tested
on 2 ranks in ``tests/distributed/test_accelerator_utilities.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fullshard import Accelerator
from fullshard.frontend.processes import runtime
from fullshard.tracking import GeneralTracker, LoggerType

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def accelerator_factory():
    made: list[Accelerator] = []

    def make(**kwargs):
        made.append(Accelerator(cpu=True, **kwargs))
        return made[-1]

    yield make
    runtime.shutdown()


def test_jsonl_and_tensorboard_write_files_their_readers_open(tmp_path: Path, accelerator_factory) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = accelerator_factory(log_with=["jsonl", LoggerType.TENSORBOARD], project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.5, "layers": 2, "name": "tiny"})
    import torch

    for step in range(3):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "note": f"step {step}"}, step=step)
    assert accelerator.get_tracker("tensorboard", unwrap=True) is accelerator.get_tracker("tensorboard").writer
    accelerator.end_training()

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["loss"] for r in records] == pytest.approx([1.0, 0.5, 1 / 3])
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.5, "layers": 2, "name": "tiny"}

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [0, 1, 2]
    assert [e.value for e in scalars] == pytest.approx([1.0, 0.5, 1 / 3])
    assert yaml.safe_load((tmp_path / "run" / "hparams.yml").read_text())["lr"] == 0.5


def test_custom_tracker_and_all(tmp_path: Path, accelerator_factory) -> None:
    class Memory(GeneralTracker):
        name = "memory"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        @property
        def tracker(self):
            return self.seen

        def log(self, values, step=None, **kwargs):
            self.seen.append((step, dict(values), kwargs))

    memory = Memory()
    accelerator = accelerator_factory(log_with=["all", memory], project_dir=tmp_path)
    assert accelerator.log_with == ["jsonl", "tensorboard", memory]  # "all": every tracker fullshard can write
    accelerator.init_trackers("p")
    accelerator.log({"a": 1}, step=7, log_kwargs={"memory": {"tag": "x"}})
    assert memory.seen == [(7, {"a": 1}, {"tag": "x"})]
    with pytest.raises(ValueError, match=re.escape("get_tracker('wandb'): no such tracker in this run")):
        accelerator.get_tracker("wandb")
    accelerator.end_training()


def test_log_with_refusals(tmp_path: Path, accelerator_factory) -> None:
    with pytest.raises(ValueError, match=re.escape("Accelerator(log_with='tensorbored'): not a tracker. Use one of")):
        accelerator_factory(log_with="tensorbored", project_dir=tmp_path)
    with pytest.raises(
        ValueError, match=re.escape("Logging with `jsonl` requires a `logging_dir`: the tracker writes files")
    ):
        accelerator_factory(log_with="jsonl")
    with pytest.warns(UserWarning, match=re.escape("fullshard has no tracker of that name")):
        accelerator = accelerator_factory(log_with=["wandb", "jsonl"], project_dir=tmp_path)
    assert accelerator.log_with == ["jsonl"]
    with pytest.raises(ValueError, match=re.escape("init_trackers(project_name='a/b')")):
        accelerator.init_trackers("a/b")


_KILLED = """
import os, signal, sys
from fullshard import Accelerator
accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=sys.argv[1])
accelerator.init_trackers("run")
for step in range(int(sys.argv[2])):
    accelerator.log({"loss": 1.0 + step, "text": "x" * 2000}, step=step)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_run_leaves_whole_lines_and_a_resumed_run_appends(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for count in (5, 3):  # the second run is the resumed one: it continues the file
        run = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path), str(count)], env=env, timeout=120)
        assert run.returncode == -signal.SIGKILL
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 0, 1, 2]
