"""SpareStorage: one freed gathered-parameter buffer, handed to the next unit that gathers as many bytes.

Each unit frees its gathered parameters (``flat_full``'s storage) after use and allocates them again at its
next gather. CUDA's caching allocator turns that into reuse; on CPU the C allocator maps fresh pages for
buffers this large, which the kernel faults in and zeroes again (medium GPT of ``benchmarks/train.py steps``: up to
30,000 minor faults per step and rank; DDP, which keeps its buckets, takes none). So a unit about to free
asks whether the next unit to gather in the same direction needs exactly as many bytes (uniform blocks);
if so the memory moves here, and that gather takes it. Memory moves between ``UntypedStorage`` objects by
swapping their data pointers: ``flat_full`` keeps its storage object, which autograd's saved views refer to.

Invariants: at most one buffer, held only from one unit's reshard to the next gather, which takes or drops
it; dropped at the end of forward and of backward, so the peak is unchanged. On CUDA the next gather's writes
are stream-ordered after the last reads of the previous owner (NCCL's stream waits on the current one), as
in the caching allocator's own reuse.
"""

from __future__ import annotations

import torch

__all__ = ["SpareStorage"]

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class SpareStorage:
    def __init__(self) -> None:
        self._held: torch.UntypedStorage | None = None

    @property
    def nbytes(self) -> int:  # held
        return 0 if self._held is None else self._held.nbytes()

    def keep(self, storage: torch.UntypedStorage) -> None:
        """Free ``storage`` (it is left with 0 bytes), keeping its memory for :meth:`take`."""
        if not _CAN_SWAP or storage.device.type == "meta" or storage.nbytes() == 0:
            storage.resize_(0)
            return
        self._held = torch.UntypedStorage(0, device=storage.device)  # drops any buffer held before
        self._held._swap_data_ptr_(storage)

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the held memory to ``storage`` (0 bytes) if it is ``nbytes`` on ``storage``'s device; else drop
        it (the next unit gathers another size) and return False: the caller allocates."""
        held, self._held = self._held, None
        if held is None or held.nbytes() != nbytes or held.device != storage.device or storage.nbytes() != 0:
            return False
        storage._swap_data_ptr_(held)
        return True

    def drop(self) -> None:
        self._held = None
