"""``ProfileKwargs`` and the ``Accelerator.profile`` context: ``torch.profiler`` with Accelerate's settings.

With ``output_trace_dir`` every rank writes its Chrome trace to ``<output_trace_dir>/profile_<rank>.json``
(Accelerate's file name) when the block ends, then waits for the other ranks, so that after the block all
traces are on disk. A block that raises writes nothing (the profile of a failed step is incomplete).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fullshard.frontend.handlers.base import KwargsHandler

__all__ = ["ProfileKwargs", "profile", "trace_file_name"]

_ACTIVITIES = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}


def trace_file_name(process_index: int) -> str:
    return f"profile_{process_index}.json"


@dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile``'s arguments; ``schedule_option`` holds ``torch.profiler.schedule``'s."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def _activity(self, name: str) -> torch.profiler.ProfilerActivity:
        available = dict(_ACTIVITIES)
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            available["xpu"] = torch.profiler.ProfilerActivity.XPU
        if name not in available:
            raise ValueError(
                f"ProfileKwargs(activities=[..., {name!r}, ...]): not an activity this machine can profile. "
                f"Use some of {sorted(available)}."
            )
        return available[name]

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` configured by these fields (not started)."""
        activities = None if self.activities is None else [self._activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@contextlib.contextmanager
def profile(
    handler: ProfileKwargs | None, process_index: int, wait_for_everyone: Callable[[], None]
) -> Iterator[torch.profiler.profile]:
    """Profile the block; see the module docstring for the trace files."""
    handler = handler or ProfileKwargs()
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    os.makedirs(handler.output_trace_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, trace_file_name(process_index)))
    wait_for_everyone()
