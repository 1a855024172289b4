"""``accelerate.data_loader``."""

from fullshard import skip_first_batches

__all__ = ["skip_first_batches"]
