"""``accelerate.test_utils.scripts.test_sync``: Accelerate's own test program, refused by name (see ``scripts``)."""

from fullshard.frontend.refused import refused_function

main = refused_function(
    "test_utils.scripts.test_sync.main", "it is Accelerate's own test program; run it with the real Accelerate"
)

__all__ = ["main"]
