"""``ProjectConfiguration``: where a project keeps its checkpoints and logs (Accelerate's fields and defaults).

With ``automatic_checkpoint_naming=True``, ``Accelerator.save_state()`` writes
``<project_dir>/checkpoints/checkpoint_<iteration>`` and keeps the newest ``total_limit`` complete ones
(``checkpoint/rotation.py``); ``load_state()`` takes the newest complete one. ``iteration`` counts saves.
``save_on_each_node`` is accepted for compatibility: fullshard's checkpoints are written by every rank into
one shared folder. ``async_save`` (fullshard's, the name of torch's ``dcp.async_save``) is ``save_state``'s
default for its ``async_save`` argument; unset, ``FULLSHARD_ASYNC_SAVE`` in the environment decides (default off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fullshard.frontend import env

__all__ = ["ASYNC_SAVE_ENV", "ProjectConfiguration"]

ASYNC_SAVE_ENV = "FULLSHARD_ASYNC_SAVE"
"""The default of ``ProjectConfiguration.async_save`` when it is not given (true/false)."""


@dataclass
class ProjectConfiguration:
    """Accelerate's ``ProjectConfiguration``: ``project_dir``, ``logging_dir`` (defaults to ``project_dir``),
    ``automatic_checkpoint_naming``, ``total_limit`` (``None``: keep all), ``iteration`` and ``save_on_each_node``;
    and fullshard's ``async_save``."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool | None = None
    """Whether ``Accelerator.save_state()`` saves in the background when its call does not say (``async_save=``);
    ``None``: ``FULLSHARD_ASYNC_SAVE`` (true/false) if set, else ``False``."""

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` too if it was not given."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def __post_init__(self) -> None:
        limit = self.total_limit
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(
                f"ProjectConfiguration(total_limit={limit!r}): expected an int >= 1 (how many checkpoints to keep), "
                "or None to keep them all."
            )
        if not isinstance(self.iteration, int) or isinstance(self.iteration, bool) or self.iteration < 0:
            raise ValueError(f"ProjectConfiguration(iteration={self.iteration!r}): expected an int >= 0.")
        if self.async_save is None:
            given = os.environ.get(ASYNC_SAVE_ENV, "").strip()
            self.async_save = env.parse_bool(given, where=ASYNC_SAVE_ENV) if given else False
        elif not isinstance(self.async_save, bool):
            raise ValueError(f"ProjectConfiguration(async_save={self.async_save!r}): expected True or False.")
        self.set_directories(self.project_dir)


def resolve_project_configuration(
    project_dir: str | os.PathLike[str] | None, project_config: ProjectConfiguration | None
) -> ProjectConfiguration:
    """Accelerate's rule: ``project_config`` if given, else a default one; ``project_dir`` fills a missing folder."""
    if project_config is not None and not isinstance(project_config, ProjectConfiguration):
        raise TypeError(
            f"Accelerator(project_config={type(project_config).__name__}): expected a ProjectConfiguration "
            "(from fullshard.utils import ProjectConfiguration)."
        )
    config = project_config if project_config is not None else ProjectConfiguration()
    if project_dir is not None and config.project_dir is None:
        config.set_directories(project_dir)
    if config.automatic_checkpoint_naming and config.project_dir is None:
        raise ValueError(
            "Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True)): no project_dir; "
            "checkpoints go to <project_dir>/checkpoints. Pass project_dir=... to ProjectConfiguration or Accelerator."
        )
    return config
