"""``accelerate.test_utils.scripts.test_ops``: Accelerate's own test program, refused by name (see ``scripts``)."""

from fullshard.frontend.refused import refused_function

main = refused_function(
    "test_utils.scripts.test_ops.main", "it is Accelerate's own test program; run it with the real Accelerate"
)

__all__ = ["main"]
