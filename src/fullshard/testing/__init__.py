"""Helpers for testing code that runs on several ranks: a reusable gloo worker pool."""

from fullshard.testing.pool import RankFailure, WorkerPool, run_on_ranks

__all__ = ["RankFailure", "WorkerPool", "run_on_ranks"]
