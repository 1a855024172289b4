"""``ShardedGradScaler``: loss scaling for float16 training where each rank holds only some gradients.

An inf or nan can appear in any rank's shard. The scaler unscales this rank's (local) gradients, then
takes the maximum of the found-inf flags over all ranks, so that every rank skips the same steps and
lowers its scale in step: the shards of one model never drift apart.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from fullshard.engine import local_tensor

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip decision is shared by all ranks of ``process_group``."""

    def __init__(
        self,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = local_tensor(param.grad)
                    by_device[grad.device].append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        for device, grads in by_device.items():
            found[device] = found_inf.to(device)
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale.to(device))
        if not found:
            found[found_inf.device] = found_inf
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients and agree with every rank on whether any of them overflowed."""
        super().unscale_(optimizer)
        if not (self._enabled and dist.is_initialized() and dist.get_world_size(self.process_group) > 1):
            return
        state = self._per_optimizer_states[id(optimizer)]
        for flag in state["found_inf_per_device"].values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
