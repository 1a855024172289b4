"""Pictures from ``train.py memory``'s JSON results (PNG, for docs/); prints the file it wrote.

    python benchmarks/plot.py timeline RESULT.json [MORE.json ...] OUT.png [--labels before after ...]
    python benchmarks/plot.py sweep RESULT1.json RESULT2.json ... docs/scale_sweep.png

``timeline``: rank 0's RSS over one training step (the second by default: the optimizer state exists),
one line per system, with the floor (and the floor plus the interpreter's RSS) drawn in and the start of
backward and of the optimizer step marked. ``sweep``: median step time and peak RSS per rank against the
parameter count, one line per system, one point per result file (one model size each).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from kit import MEMORY

GiB = 2**30
COLORS = dict(zip(MEMORY, ("tab:blue", "tab:cyan", "tab:orange")))  # the systems of ``train.py memory``


def _color(name: str) -> str:
    if "before" in name:
        return "tab:red"
    return next((color for base, color in COLORS.items() if name.startswith(base)), "tab:gray")


def _one_step(timeline: list[list[Any]], step: int) -> list[list[Any]]:
    """Samples from ``step``'s start marker to its end marker (or the end: older results may lack it)."""
    start = next((i for i, s in enumerate(timeline) if s[2] == f"step {step} start"), None)
    if start is None:  # fall back to the sample after the previous step's zero_grad
        start = max((i for i, s in enumerate(timeline) if s[2] == "zero_grad"), default=0)
    end = next((i for i, s in enumerate(timeline) if i > start and s[2] == f"step {step} end"), len(timeline) - 1)
    return timeline[start : end + 1]


def timeline(result: dict[str, Any], out: str, step: int, rank: int) -> None:
    fig, ax = plt.subplots(figsize=(11, 5.5))
    floor = None
    for name, res in result["systems"].items():
        row = res["ranks"][rank]
        samples = _one_step(row["timeline"], step)
        # Time as a fraction of the step: runs on a loaded machine differ in speed, not in shape.
        t0, span = samples[0][0], max(samples[-1][0] - samples[0][0], 1e-9)
        xs = [(s[0] - t0) / span for s in samples]
        ys = [s[1] / GiB for s in samples]
        style = "--" if "+AC" in name else "-"
        ax.plot(xs, ys, style, color=_color(name), lw=1.2, label=f"{name} (peak {row['peak'] / GiB:.2f} GiB)")
        for marker, label in (("backward", "backward"), ("optimizer step", "optimizer")):
            first = next((s for s in samples if s[2].startswith(marker)), None)
            if first is not None:
                ax.axvline((first[0] - t0) / span, color=_color(name), ls=":", lw=0.8)
                ax.text(
                    (first[0] - t0) / span,
                    ax.get_ylim()[0],
                    f" {label}",
                    color=_color(name),
                    fontsize=7,
                    rotation=90,
                    va="bottom",
                )
        floor = (sum(res["floor"].values()), row["baseline"])
    if floor is not None:
        ax.axhline(
            floor[0] / GiB, color="black", lw=1, label=f"floor 16Ψ/N + 2 units + activations ({floor[0] / GiB:.2f})"
        )
        ax.axhline(sum(floor) / GiB, color="gray", lw=1, ls="--", label=f"floor + interpreter ({sum(floor) / GiB:.2f})")
    cfg = result["config"]
    ax.set_title(
        f"RSS of rank {rank} over training step {step}: {result['params'] / 1e6:.0f}M-parameter GPT "
        f"({cfg['n_layer']}x{cfg['n_embd']}), fp32 AdamW, {result['world']} gloo ranks"
    )
    ax.set_xlabel("fraction of the step (forward, backward, optimizer)")
    ax.set_ylabel("resident set size (GiB)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.text(
        0.01,
        0.01,
        f"{result['machine']['cpu']} ({result['machine']['flags']}), load {result['machine']['load']}, "
        f"MALLOC_MMAP_THRESHOLD_={result['machine']['malloc_mmap_threshold']}",
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def sweep(results: list[dict[str, Any]], out: str) -> None:
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = sorted({n for r in results for n in r["systems"]})
    for name in names:
        points = []
        for r in sorted(results, key=lambda r: r["params"]):
            if name not in r["systems"]:
                continue
            ranks = r["systems"][name]["ranks"]
            steps = [max(rk["step_s"][i] for rk in ranks) for i in range(1, len(ranks[0]["step_s"]))]
            points.append(
                (
                    r["params"] / 1e6,
                    statistics.median(steps),
                    max(rk["peak"] for rk in ranks) / GiB,
                    sum(r["systems"][name]["floor"].values()) / GiB,
                )
            )
        if not points:
            continue
        xs = [p[0] for p in points]
        style = "--" if "+AC" in name else "-"
        ax_t.plot(xs, [p[1] for p in points], style + "o", color=_color(name), label=name)
        ax_m.plot(xs, [p[2] for p in points], style + "o", color=_color(name), label=name)
    floors = sorted(
        {(r["params"] / 1e6, sum(next(iter(r["systems"].values()))["floor"].values()) / GiB) for r in results}
    )
    ax_m.plot([f[0] for f in floors], [f[1] for f in floors], "k-", lw=1, label="floor")
    for ax, title, unit in ((ax_t, "step time", "seconds"), (ax_m, "peak RSS per rank", "GiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    machine = results[0]["machine"]
    fig.text(0.01, 0.01, f"{machine['cpu']} ({machine['flags']}), 2 gloo ranks, fp32 AdamW", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("timeline", "sweep"))
    parser.add_argument("paths", nargs="+", help="result JSON file(s), then the output PNG")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument(
        "--labels", nargs="*", default=None, help="timeline: a suffix per input file, to draw several runs in one plot"
    )
    args = parser.parse_args()
    *inputs, out = args.paths
    results = []
    for path in inputs:
        with open(path) as f:
            results.append(json.load(f))
    if args.kind == "timeline":
        merged = dict(results[0], systems={})
        for i, result in enumerate(results):
            suffix = f" ({args.labels[i]})" if args.labels and args.labels[i] else ""
            merged["systems"].update({name + suffix: res for name, res in result["systems"].items()})
        timeline(merged, out, args.step, args.rank)
    else:
        sweep(results, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
