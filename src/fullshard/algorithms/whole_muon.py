"""Muon's whole-parameter step split at Newton-Schulz: only the orthogonalisation's input and output travel.

[Note: split Muon steps]
``torch.optim.Muon``'s update of one matrix is element-wise except for one call: per parameter it does
``buf.lerp_(grad, 1 - momentum)``, ``update = grad.lerp(buf, momentum)`` (or ``buf`` without Nesterov),
``_zeropower_via_newtonschulz(update)`` (whose first operation is ``update.bfloat16()``, and which needs the whole
matrix), then ``param.mul_(1 - lr * weight_decay)`` and ``param.add_(orthogonalised, alpha=-adjusted_lr)``, with
``adjusted_lr`` from the whole shape. The pipelined path of ``whole_pipeline.py`` sends an owner the parameter, the
gradient and the momentum (fp32, 12 bytes an element) and sends back the parameter and the momentum (8 bytes), and
the owner runs Muon's own step on them whole. Here every rank runs the element-wise parts on its own rows, where
they live, and only Newton-Schulz's input, already rounded to bf16 as its first line does, goes to the owner (2 bytes
an element), and only its bf16 output comes back (2 bytes): 4 bytes an element instead of 20, no parameter or
momentum held whole, and none of the exchange's copies of them.

Numerics: bitwise Muon's step on the whole matrix. Element-wise kernels give each element the same bits on a row
slice as on the whole tensor (the same operation on the same two or three inputs; checked on both ends of
vectorised loops by ``tests/distributed/test_whole_step.py``, which compares with the unsharded Muon by
``torch.equal`` on 1, 2 and 4 ranks), bf16 rounding is element-wise, and Newton-Schulz runs once, on the owner, on
the same bf16 matrix as the unsharded step's. The state at rest is what it was (the momentum as rows of the
parameter), so checkpoints and resharding do not see the difference.

When: under the conditions of ``_can_pipeline`` (``torch.optim.Muon`` itself, dim-0 rows on a 1-D shard group, the
state's kinds known from the second step) and when the state is Muon's own and nothing else (one per-element
``momentum_buffer``). Otherwise the pipelined path runs, which steps with the optimizer's own code.

Schedule: the element-wise first half runs for every matrix at once; then owner slot after owner slot, as in
[Note: pipelined whole steps], with the gathers of the next ``_AHEAD`` slots in flight while an owner computes
Newton-Schulz, and each slot's result sent back as soon as it is computed; each rank finishes a slot (the weight
decay and the update, on its rows) when its bytes arrive. Everything is finished before the pre-hook returns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullshard.algorithms.whole_owners import Bucket, Entry
from fullshard.algorithms.whole_pieces import as_bytes, concat, nbytes, rows_of
from fullshard.algorithms.whole_pipeline import _AHEAD
from fullshard.engine import local_tensor

__all__ = ["SplitMuonSteps"]

_MOMENTUM = "momentum_buffer"


class SplitMuonSteps:
    """``WholeParamStep``'s split path for ``torch.optim.Muon``; see [Note: split Muon steps]. Reads the hook's
    ``optimizer``, ``_specs`` and ``_position``."""

    def _can_split(self, bucket: Bucket) -> bool:
        """Given that the bucket can be pipelined: whether every stepping parameter's state is Muon's momentum alone
        (the same answer on every rank: the kinds are the owner's, sent once)."""
        return all(
            [name for name, _ in self._specs[id(e.param)]] == [_MOMENTUM]
            and self._specs[id(e.param)][0][1][0] == "rows"
            for e in bucket.entries
            if e.param.grad is not None
        )

    def _split_step(self, bucket: Bucket) -> None:
        """Muon's step on every stepping matrix of ``bucket``: element-wise on the rows here, Newton-Schulz whole on
        its owner, slot after slot with the exchange in the background. ``bucket.stepping``: the matrices with a
        gradient (set by ``_pipeline``)."""
        inputs = {id(e.param): self._first_half(e) for e in bucket.stepping}  # bf16 rows of each Newton-Schulz input
        owned = [[e for e in bucket.stepping if e.owner == o] for o in range(bucket.world)]
        slots = max((len(es) for es in owned), default=0)
        me = bucket.rank
        gathers: list[tuple[list[Any], torch.Tensor | None]] = []  # per slot: its works, the whole input if mine

        def slot(j: int) -> dict[int, Entry]:  # owner -> its j-th matrix
            return {o: es[j] for o, es in enumerate(owned) if j < len(es)}

        def post_gather(j: int) -> None:
            to = slot(j)
            send = concat([as_bytes(inputs[id(e.param)]) for _, e in sorted(to.items())])
            in_splits = [nbytes(to[o], me, torch.bfloat16) if o in to else 0 for o in range(bucket.world)]
            mine = to.get(me)
            whole = torch.empty(mine.sp.layout.shape, dtype=torch.bfloat16) if mine is not None else None
            out = as_bytes(whole) if whole is not None else torch.empty(0, dtype=torch.uint8)
            out_splits = [nbytes(mine, r, torch.bfloat16) for r in range(bucket.world)] if mine else [0] * bucket.world
            work = dist.all_to_all_single(out, send, out_splits, in_splits, group=bucket.pg, async_op=True)
            gathers.append(([work, send], whole))

        for j in range(min(_AHEAD, slots)):
            post_gather(j)
        scatters: list[tuple[Any, torch.Tensor, dict[int, Entry], list[int]]] = []
        for j in range(slots):
            works, whole = gathers[j]
            works[0].wait()
            gathers[j] = ([], None)
            if j + _AHEAD < slots:
                post_gather(j + _AHEAD)
            at = slot(j)
            for sent in at.values():
                inputs.pop(id(sent.param))
            e = at.get(me)
            send, in_splits = torch.empty(0, dtype=torch.uint8), [0] * bucket.world
            if e is not None and whole is not None:
                group = self._group_of(e)
                result = torch.optim._muon._zeropower_via_newtonschulz(
                    whole, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                del whole
                send = concat([as_bytes(rows_of(e, result, r)) for r in range(bucket.world)])
                in_splits = [nbytes(e, r, torch.bfloat16) for r in range(bucket.world)]
                del result
            out_splits = [nbytes(at[o], me, torch.bfloat16) if o in at else 0 for o in range(bucket.world)]
            out = torch.empty(sum(out_splits), dtype=torch.uint8)
            work = dist.all_to_all_single(out, send, out_splits, in_splits, group=bucket.pg, async_op=True)
            scatters.append((work, out, at, out_splits))
            del send
            if len(scatters) > _AHEAD:
                self._second_half(*scatters.pop(0))
        while scatters:
            self._second_half(*scatters.pop(0))

    def _group_of(self, e: Entry) -> dict[str, Any]:
        return self.optimizer.param_groups[self._position[id(e.param)][0]]

    def _first_half(self, e: Entry) -> torch.Tensor:
        """Muon's element-wise steps before Newton-Schulz on this rank's rows: the momentum (in place) and the
        bf16 input, as rows."""
        group = self._group_of(e)
        momentum = group["momentum"]
        grad = local_tensor(e.param.grad).detach()
        buf = local_tensor(self.optimizer.state[e.param][_MOMENTUM])
        with torch.no_grad():
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            return update.bfloat16()

    def _second_half(self, work: Any, out: torch.Tensor, at: dict[int, Entry], out_splits: list[int]) -> None:
        """Wait for a slot's results; apply each to this rank's rows: weight decay, then the orthogonalised update."""
        work.wait()
        offset = 0
        for o in range(len(out_splits)):
            if o not in at:
                continue
            e = at[o]
            update = out.narrow(0, offset, out_splits[o]).view(torch.bfloat16)
            offset += out_splits[o]
            group = self._group_of(e)
            lr = torch.optim._muon._to_scalar(group["lr"])
            adjusted_lr = torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], torch.Size(e.sp.shape))
            param = local_tensor(e.param)
            with torch.no_grad():
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.view(param.shape), alpha=-adjusted_lr)
