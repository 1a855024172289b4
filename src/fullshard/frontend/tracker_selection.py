"""Which trackers a run logs to (``Accelerator(log_with=...)``) and the calls the Accelerator forwards to them.

``log_with`` takes names (``"jsonl"``, ``"tensorboard"``, ``"all"``, Accelerate's other names), ``LoggerType``
members and :class:`GeneralTracker` instances, alone or in a list. It is checked when the Accelerator is built,
on every rank, so that a bad name or a missing ``project_dir`` fails before training starts:

- an unknown name raises ``ValueError``;
- a tracker that writes files needs a logging directory (``project_dir`` or ``ProjectConfiguration``);
- a name fullshard does not ship a tracker for (``wandb``, ...), or ``tensorboard`` without the ``tensorboard``
  package, is skipped with a warning from rank 0 (Accelerate skips unavailable trackers too).

:meth:`TrackerSet.log` runs on the main process only, as ``Accelerator.log`` does in Accelerate; ``start``,
``store_init_configuration`` and ``finish`` are called on every rank, and each tracker decides (see
``trackers.on_main_process``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from fullshard.frontend.availability import is_tensorboard_available
from fullshard.frontend.trackers import GeneralTracker, JSONLinesTracker, LoggerType, TensorBoardTracker

__all__ = ["LOGGER_TYPE_TO_CLASS", "TrackerSet", "available_trackers", "register_tracker_class", "resolve_log_with"]

BUILTIN: dict[str, type[GeneralTracker]] = {"jsonl": JSONLinesTracker, "tensorboard": TensorBoardTracker}
# Accelerate's name for the registry of trackers by name: the built-in ones and those register_tracker_class adds.
LOGGER_TYPE_TO_CLASS = BUILTIN


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with=tracker_class.name`` build ``tracker_class`` (as Accelerate's ``register_tracker_class``).

    The class must subclass :class:`GeneralTracker` and say ``name`` and ``requires_logging_directory``; it is built
    as ``tracker_class(project_name, logging_dir, **init_kwargs)`` when it needs the directory, else without it.
    Registering a name again replaces the class, with a warning.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class({tracker_class!r}): expected a subclass of GeneralTracker.")
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}): the class needs a non-empty `name` attribute (the "
            "string passed as log_with)."
        )
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}): set the class attribute requires_logging_directory "
            "(True if the tracker writes under the project's logging directory, else False)."
        )
    if name in BUILTIN and BUILTIN[name] is not tracker_class:
        warnings.warn(
            f"register_tracker_class({tracker_class.__name__}): replaces {BUILTIN[name].__name__} as tracker {name!r}.",
            stacklevel=2,
        )
    BUILTIN[name] = tracker_class


def available_trackers() -> list[str]:
    """The tracker names fullshard can write to in this environment (what ``log_with="all"`` selects)."""
    return ["jsonl", *(["tensorboard"] if is_tensorboard_available() else [])]


def _skip(name: str, why: str, is_main: bool) -> None:
    if is_main:
        warnings.warn(f"Accelerator(log_with=[..., {name!r}, ...]): {why}; not logging to it.", stacklevel=4)


def resolve_log_with(
    log_with: Any, logging_dir: str | os.PathLike[str] | None, *, is_main: bool
) -> list[str | GeneralTracker]:
    """The trackers to build at ``init_trackers``: names of built-in trackers, and tracker instances as given."""
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[str | GeneralTracker] = []
    for entry in entries:
        if isinstance(entry, GeneralTracker):
            resolved.append(entry)
            continue
        name = str(getattr(entry, "value", entry))
        if name not in LoggerType and name not in BUILTIN:
            raise ValueError(
                f"Accelerator(log_with={entry!r}): not a tracker. Use one of {LoggerType.list()}, or an instance of "
                "a GeneralTracker subclass (from fullshard.tracking import GeneralTracker)."
            )
        names = available_trackers() if name == "all" else [name]
        for one in names:
            if one == "tensorboard" and not is_tensorboard_available():
                _skip(one, "the tensorboard package is not installed (pip install tensorboard)", is_main)
            elif one not in BUILTIN:
                _skip(one, "fullshard has no tracker of that name (pass a GeneralTracker instance for it)", is_main)
            elif one not in resolved:
                resolved.append(one)
    if logging_dir is None:
        needing = [str(e) for e in resolved if isinstance(e, str) and BUILTIN[e].requires_logging_directory]
        if needing:
            raise ValueError(
                f"Accelerator(log_with={log_with!r}): Logging with `{needing[0]}` requires a `logging_dir`: the "
                "tracker writes files. Pass project_dir='runs' (or "
                "project_config=ProjectConfiguration(logging_dir=...))."
            )
    return resolved


class TrackerSet:
    """The started trackers of one Accelerator; see the module docstring for which rank does what."""

    def __init__(self, entries: list[str | GeneralTracker], logging_dir: str | os.PathLike[str] | None) -> None:
        self.entries = entries
        self.logging_dir = logging_dir
        self.trackers: list[GeneralTracker] = []

    def start(self, project_name: str, config: dict[str, Any] | None, init_kwargs: dict[str, Any] | None) -> None:
        if not isinstance(project_name, str) or not project_name or os.sep in project_name:
            raise ValueError(
                f"init_trackers(project_name={project_name!r}): expected a non-empty name without '{os.sep}' "
                "(trackers write under <project_dir>/<project_name>/)."
            )
        init_kwargs = init_kwargs or {}
        for entry in self.entries:
            if isinstance(entry, GeneralTracker):
                self.trackers.append(entry)
            else:
                cls, kwargs = BUILTIN[entry], init_kwargs.get(entry, {})
                where = (self.logging_dir,) if cls.requires_logging_directory else ()
                self.trackers.append(cls(project_name, *where, **kwargs))
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get(self, name: str, unwrap: bool = False) -> Any:
        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"get_tracker({name!r}): no such tracker in this run; it has {[t.name for t in self.trackers]}."
        )

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None, is_main: bool) -> None:
        if not is_main:
            return
        if not hasattr(values, "items"):
            raise TypeError(f"Accelerator.log(values={type(values).__name__}): expected a dict of name -> value.")
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
