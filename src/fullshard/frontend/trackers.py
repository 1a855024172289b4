"""Experiment trackers: the ``GeneralTracker`` interface, a JSON-lines tracker and a TensorBoard tracker.

[Note: tracker files]
Each tracker writes under ``<logging_dir>/<project_name>/``:

- ``jsonl``: ``metrics.jsonl``, one JSON object per ``log`` call (``{"step": ..., "time": ..., <values>}``),
  written with one ``write`` and flushed, so a reader (or a run killed mid-training) sees only whole lines.
  The file is appended to, so a resumed run continues it. ``config.json`` holds ``init_trackers``' config.
- ``tensorboard``: TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``), flushed after every
  ``log``; ``hparams.yml`` holds the config.

A tracker with ``main_process_only = True`` (both here) is started, logged to and finished on rank 0 only;
the other ranks hold an idle object (``TrackerSet`` in ``tracker_selection.py`` decides).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fullshard.frontend import ops
from fullshard.frontend.enums import ContainsByValue
from fullshard.frontend.ops import listify

__all__ = ["GeneralTracker", "JSONLinesTracker", "LoggerType", "TensorBoardTracker", "on_main_process"]


class LoggerType(enum.Enum, metaclass=ContainsByValue):
    """Tracker names for ``Accelerator(log_with=...)`` (Accelerate's values, plus ``JSONL``).

    fullshard writes ``TENSORBOARD`` and ``JSONL``; the others are accepted names whose trackers fullshard does
    not ship (pass a :class:`GeneralTracker` of your own for them). ``ALL``: every tracker fullshard can write.
    """

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """For tracker methods: run only on rank 0 when the tracker's ``main_process_only`` is true."""

    @functools.wraps(function)
    def maybe_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not ops.is_main_process():
            return None
        return function(self, *args, **kwargs)

    return maybe_run


class GeneralTracker:
    """Base of every tracker. Subclasses set ``name`` (str), ``requires_logging_directory`` (bool) and a
    ``tracker`` property (the underlying object, e.g. a ``SummaryWriter``), and override ``start``,
    ``store_init_configuration``, ``log`` and ``finish`` as they need."""

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [a for a in ("name", "requires_logging_directory") if not hasattr(type(self), a)]
        if "tracker" not in dir(type(self)):
            missing.append("tracker")
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__}: a tracker class must define {', '.join(missing)} (name: str, "
                "requires_logging_directory: bool, tracker: a property returning the underlying logger)."
            )

    def start(self) -> None:
        """Open the run (called by ``init_trackers``)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Close the run (called by ``end_training``)."""


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors become numbers or lists; NaN and infinities become strings JSON can hold."""
    value = listify(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class JSONLinesTracker(GeneralTracker):
    """Metrics as JSON lines, no dependency; see [Note: tracker files]."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"JSONLinesTracker: unexpected init_kwargs {sorted(kwargs)} (it takes none).")
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self._file: Any = None

    @property
    def tracker(self) -> Any:
        """The open ``metrics.jsonl`` file object."""
        return self._file

    @property
    def metrics_file(self) -> Path:
        return self.logging_dir / "metrics.jsonl"

    @on_main_process
    def start(self) -> None:
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.metrics_file, "a", encoding="utf-8")  # noqa: SIM115 (closed by finish)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        path = self.logging_dir / "config.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_plain(values), indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)  # a reader never sees half a config

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            raise RuntimeError("JSONLinesTracker.log before start(): call accelerator.init_trackers(...) first.")
        record = {"step": step, "time": round(time.time(), 3), **_plain(dict(values))}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @on_main_process
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files (needs the ``tensorboard`` package); see [Note: tracker files].

    ``log`` writes numbers with ``add_scalar``, strings with ``add_text`` and dicts of numbers with
    ``add_scalars``, as Accelerate's tracker does. ``init_kwargs`` go to ``SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is an optional extra

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import yaml

        self.writer.add_hparams(values, metric_dict={}, run_name=".")
        self.writer.flush()
        with open(os.path.join(self.logging_dir, "hparams.yml"), "w", encoding="utf-8") as out:
            yaml.safe_dump(_plain(values), out)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in listify(dict(values)).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
