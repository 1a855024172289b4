"""``accelerate.utils.random``."""

from fullshard.utils import set_seed, synchronize_rng_state, synchronize_rng_states

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]
