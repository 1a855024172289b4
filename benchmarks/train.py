"""Training benchmarks: a GPT on 2 gloo CPU ranks under fullshard and its peers, one mode per question.

    python benchmarks/train.py steps [--steps 12] [--layers 4] [--width 256] [--systems NAME ...]
        [--passes N | --interleave] [--pin_ranks] [--direct_min_mb MB] [--trace DIR]
    python benchmarks/train.py memory [--quick] [--layers 16 --width 2048 --heads 16 --vocab 8192] [--steps 3]
        [--systems NAME ...] [--accumulate K] [--no-ddp] [--ddp_cap_gib G] [--cap_all] [--inflight N] [--out F]
    python benchmarks/train.py layout [--width 256] [--repeats 30]
    python benchmarks/train.py peak [--layers 4 --width 512] [--world 1 2 4] [--strategies ...] [--ac] [--out F]
    python benchmarks/train.py peak --compare F.json [...]

Every mode first prints the machine (``fullshard.testing.bench.describe_machine``). The systems are those of
``benchmarks/kit.py`` (``--systems`` takes their names; ``memory`` also the short "fullshard FSDP" and "torch
FSDP2", then " +AC" and/or " sharded accumulation"). This file parses the command line; each mode lives in a
module of its own: ``train_steps.py`` (``steps``, ``layout``), ``train_memory.py`` and ``train_peak.py``.

``steps``: speed. Per system, the median step time of the slowest rank and its ratio to torch FSDP2 (bf16 rows:
to torch FSDP2 bf16) and to DDP; CPU time per step and rank (every thread), the part in the kernel (on loopback
TCP mostly the collectives' bytes copied through sockets), minor page faults; the bytes each rank holds in
parameters + gradients + optimizer states (and that over model-state bytes / N); the bytes moved through
collectives per step (counted by a dispatch mode on the c10d ops; point-to-point sends as sent) beside the
theoretical figure (FULL_SHARD 3 x model bytes x (N-1)/N, SHARD_GRAD_OP and NO_SHARD/DDP 2 x); the exposed
all-gather wait. Under the table, each system's CPU floor (CPU time of all ranks per step over the cores they
share, as a ratio to DDP's step). ``--passes N`` runs the systems N times in alternating order, pooled;
``--interleave`` builds all of them side by side and alternates step by step (ratios paired per step);
``--pin_ranks`` runs rank r (and its gloo threads) on CPU r only. ``--trace DIR`` profiles one fullshard system
instead: ``DIR/trace_rank<r>.json`` (Chrome trace) and a per-step breakdown from the engine's ``fullshard::``
profiler ranges (exposed all-gather and reduce waits, copies, optimizer, compute).

``memory``: peak memory at scale (default: the issue's 840M GPT, 16 layers x 2048, vocabulary 8192, sequence
128, local batch 1). Each system runs in fresh ranks from the same weights on the same data and prints a row:
median step time after the first, peak RSS per rank (``VmHWM``, reset once the model is wrapped), the floor
(16 Psi / N + 2 x the largest unit gathered + the activations autograd saves) and the losses, which must agree;
then each fullshard system against torch FSDP2 with the same checkpointing / accumulation, and whether DDP fits
under a per-rank address-space cap (``RLIMIT_AS``, default half the machine per rank). ``--accumulate K``
compares ``no_sync`` with sharded accumulation. Results (with an RSS timeline by phase, for ``plot.py``) go to
``--out`` and per-rank peaks are merged into ``--peaks`` (``estimate-memory``'s calibration).

``layout``: one flat all-gather per unit against one per parameter, for one block's parameters: median ms of
each and their ratio.

``peak``: peak RSS per rank of a few FSDP steps (meta init, unit by unit) for each world size and strategy,
beside ``estimate-memory``'s prediction and the error; ``--compare`` measures nothing and prints saved rows
(this mode's or ``memory``'s peaks.json) beside today's estimate.
"""

from __future__ import annotations

from train_memory import memory_args, memory_main
from train_peak import peak_args, peak_main
from train_steps import layout_args, layout_main, steps_args, steps_main

from fullshard.testing.bench import run_mode

MODES = {
    "steps": (steps_args, steps_main, "step time, CPU, traffic and state of each system (or --trace one)"),
    "memory": (memory_args, memory_main, "peak RSS per rank at scale against the floor; DDP under a cap"),
    "layout": (layout_args, layout_main, "one flat all-gather per unit against one per parameter"),
    "peak": (peak_args, peak_main, "peak RSS per rank against estimate-memory's prediction"),
}


def main() -> None:
    run_mode(__doc__, MODES)


if __name__ == "__main__":
    main()
