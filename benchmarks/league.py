"""The algorithm league on the text renderer: held-out OCR of every run under a directory, as tables and one plot.

Runs are the experiment's presets, named `<cpu|gpu>_<algo>_s<seed>` by --exp-name, e.g.

    for a in grpo dppo mixgrpo nft awm; do for s in 42 43 44 45; do
      python experiments/qwen_image_ocr.py $([ $a = grpo ] && echo tiny || echo $a-tiny) --seed $s \
          --exp-name cpu_${a}_s$s --run.out-dir runs/league; done; done
    python experiments/qwen_image_ocr.py nft-tiny-gpu --seed 7 --exp-name gpu_nft_s7 --run.out-dir runs/league
    python benchmarks/league.py runs/league --plot benchmarks/figures/league.png

CPU table: held-out OCR at the start and the end of each algorithm's runs (mean +- std over seeds). GPU table:
seconds of wall time (the sum of the logged step times, validation included; process start not counted) until
the first validation at or above 0.9, the last validation at or before 300 s, and the last validation of the run;
then per algorithm over its seeds.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

from fgrpo.logging import read_metrics

ALGOS = ("grpo", "dppo", "mixgrpo", "nft", "awm")
NAME = re.compile(r"^(cpu|gpu)_([a-z]+)_s(\d+)$")


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, wall seconds before the validation's step ends, held-out OCR) of every validation row."""
    out, t = [], 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        t += r.get("time/total", 0.0)
        if r.get("val/reward_mean") is not None:
            out.append((r["step"], t, r["val/reward_mean"]))
    return out


def first_hit(v: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first validation at or above target, or None."""
    return next(((s, t) for s, t, y in v if y >= target), None)


def score_at(v: list[tuple[int, float, float]], seconds: float, run_seconds: float) -> float | None:
    """The last validation at or before `seconds` of wall time; None if the run logged none by then or
    stopped (after `run_seconds` of logged steps) before that time, where its score is unknown."""
    before = [y for _, t, y in v if t <= seconds]
    return before[-1] if before and run_seconds >= seconds else None


def _fmt_hit(h: tuple[int, float] | None) -> str:
    return "not reached" if h is None else f"{h[1]:.0f} s (step {h[0]})"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("root", type=Path, help="directory holding the run directories")
    ap.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--at-seconds", type=float, default=300.0, help="GPU table: the score at this wall time")
    args = ap.parse_args()

    runs: dict[str, dict[str, dict[int, list]]] = {"cpu": defaultdict(dict), "gpu": defaultdict(dict)}
    seconds: dict[tuple[str, int], float] = {}  # logged wall time of each GPU run
    for d in sorted(args.root.iterdir()):
        m = NAME.match(d.name)
        if m and (d / "metrics.jsonl").is_file():
            rows = read_metrics(d / "metrics.jsonl")
            runs[m.group(1)][m.group(2)][int(m.group(3))] = curve(rows)
            seconds[m.group(2), int(m.group(3))] = sum(r.get("time/total", 0.0) for r in rows)

    print(
        "| algorithm | seeds | start | end (mean ± std) | per seed | gain (smallest) |\n|---|---|---|---|---|---|"
    )
    for algo in ALGOS:
        c = runs["cpu"].get(algo)
        if not c:
            continue
        starts = [v[0][2] for v in c.values()]
        ends = [v[-1][2] for v in c.values()]
        gains = [e - s for s, e in zip(starts, ends)]
        std = statistics.stdev(ends) if len(ends) > 1 else float("nan")
        print(
            f"| {algo} | {len(c)} | {statistics.mean(starts):.3f} | {statistics.mean(ends):.3f} ± {std:.3f} | "
            f"{' / '.join(f'{e:.3f}' for e in ends)} | {statistics.mean(gains):+.3f} ({min(gains):+.3f}) |"
        )

    at = args.at_seconds
    print(
        f"\n| algorithm | seed | first >= {args.target} | at {at:.0f} s | last validation (step, s) |"
        "\n|---|---|---|---|---|"
    )
    for algo in ALGOS:
        for seed, v in sorted(runs["gpu"].get(algo, {}).items()):
            print(
                f"| {algo} | {seed} | {_fmt_hit(first_hit(v, args.target))} | {_fmt(score_at(v, at, seconds[algo, seed]))} | "
                f"{v[-1][2]:.3f} (step {v[-1][0]}, {v[-1][1]:.0f} s) |"
            )
    print(
        f"\n| algorithm | seeds | first >= {args.target}, per seed | reached | at {at:.0f} s (mean ± std) |"
        "\n|---|---|---|---|---|"
    )
    for algo in ALGOS:
        g = runs["gpu"].get(algo)
        if not g:
            continue
        hits = [first_hit(v, args.target) for _, v in sorted(g.items())]  # in seed order
        scores = [x for x in (score_at(v, at, seconds[algo, k]) for k, v in g.items()) if x is not None]
        std = statistics.stdev(scores) if len(scores) > 1 else float("nan")
        print(
            f"| {algo} | {len(g)} | {' / '.join(_fmt_hit(h) for h in hits)} | "
            f"{sum(h is not None for h in hits)} of {len(hits)} | "
            + (f"{statistics.mean(scores):.3f} ± {std:.3f} |" if scores else "- |")
        )

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        colors = dict(zip(ALGOS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
        for ax, kind, x_of in ((axes[0], "cpu", 0), (axes[1], "gpu", 1)):
            for algo in ALGOS:
                for i, (_, v) in enumerate(sorted(runs[kind].get(algo, {}).items())):
                    ax.plot(
                        [p[x_of] for p in v],
                        [p[2] for p in v],
                        color=colors[algo],
                        alpha=0.8,
                        marker=".",
                        label=algo if i == 0 else None,
                    )
            ax.axhline(args.target, color="grey", lw=0.8, ls="--")
            ax.set_ylabel("held-out OCR (validation)")
            ax.grid(alpha=0.3)
        axes[0].set_xlabel("training step (CPU presets: 32 images a step)")
        axes[0].set_title("CPU budget, every seed")
        axes[1].set_xlabel("wall seconds (tiny-gpu presets: 512 images a step)")
        axes[1].set_title("one GPU")
        axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
