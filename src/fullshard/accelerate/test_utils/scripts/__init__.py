"""``accelerate.test_utils.scripts``: Accelerate's own distributed test programs, which fullshard does not serve.

Each module (``test_script``, ``test_sync``, ``test_ops``, ...) exists so that ``from accelerate.test_utils import
test_sync`` imports; its ``main`` raises ``NotImplementedError`` naming the script. Run those scripts with the real
Accelerate; fullshard's own tests (``tests/``) cover the same behaviour for its FSDP path.
"""

from fullshard.accelerate.test_utils.scripts import test_ops, test_script, test_sync

__all__ = ["test_ops", "test_script", "test_sync"]
