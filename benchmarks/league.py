"""The algorithm league on the text renderer: every run's whole held-out curve, per algorithm, as tables and one plot.

Runs are the experiment's presets, named `<cpu|gpu>_<label>_s<seed>` by --exp-name (label: the algorithm, or the
algorithm and a variant, e.g. `nft-decay1`), all under one directory:

    benchmarks/league_launch.sh runs/league "grpo dppo mixgrpo nft awm" "60 61 62" --num-steps 300 \\
        --reward.val-workers 2                          # one GPU machine, all at once
    python benchmarks/league.py runs/league --steps 300 --plot benchmarks/figures/league.png \
        --keep benchmarks/league_runs/DATE_COMMIT       # the rows the league reads, kept with the record
    python benchmarks/league.py benchmarks/league_runs/A benchmarks/league_runs/B   # one league over two calls
    python benchmarks/league.py A B --only grpo,mixgrpo-w04 --label mixgrpo-w04=mixgrpo   # a variant as its preset

Per run: the best validation and its step, the final one, the area under the curve (the mean held-out score
over the run's steps, trapezoids between validations), the first validation at or above the target (its step and
the wall seconds before it: the sum of the logged step times, validations included, process start not), and
whether it held: it ran to the end (--steps), never fell more than --held-drop below its best after reaching
it, and ended at or above the target. Per label: the same over its seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fgrpo.logging import read_metrics

NAME = re.compile(r"^(cpu|gpu)_([a-z0-9.-]+)_s(\d+)$")


@dataclass
class Run:
    """One run's validations: (step, wall seconds before its step ends, held-out score), in step order."""

    points: list[tuple[int, float, float]]

    @classmethod
    def of(cls, rows: list[dict], key: str = "val/reward_mean") -> Run:
        """The run's validations of `key` (the held-out score, or a gold statistic such as val/gold/white_frac)."""
        out, t = [], 0.0
        for r in sorted(rows, key=lambda r: r["step"]):
            t += r.get("time/total", 0.0)
            if r.get(key) is not None:
                out.append((r["step"], t, r[key]))
        return cls(out)

    @property
    def best(self) -> tuple[int, float]:
        """(step, score) of the first validation with the highest score."""
        i = max(range(len(self.points)), key=lambda i: (self.points[i][2], -i))
        return self.points[i][0], self.points[i][2]

    @property
    def final(self) -> tuple[int, float]:
        return self.points[-1][0], self.points[-1][2]

    def auc(self) -> float:
        """Mean score over the steps the curve spans (trapezoids between validations)."""
        p = self.points
        if len(p) < 2:
            return p[0][2]
        area = sum((b[0] - a[0]) * (a[2] + b[2]) / 2 for a, b in zip(p, p[1:]))
        return area / (p[-1][0] - p[0][0])

    def first_at(self, target: float) -> tuple[int, float] | None:
        """(step, seconds) of the first validation at or above target, or None."""
        return next(((s, t) for s, t, y in self.points if y >= target), None)

    def worst_after_best(self) -> float:
        """How far below its best the curve fell after reaching it (0 when it never did)."""
        i = max(range(len(self.points)), key=lambda i: (self.points[i][2], -i))
        return self.points[i][2] - min(y for _, _, y in self.points[i:])

    def held(self, steps: int, drop: float, target: float) -> bool:
        return self.final[0] >= steps and self.worst_after_best() <= drop and self.final[1] >= target


def _run_dirs(roots: list[Path]) -> list[tuple[str, str, int, Path]]:
    """(kind, label, seed, metrics file) of every run directory under the roots; the same run in two roots is an
    error, so two calls' runs are never mixed into one curve."""
    out, seen = [], {}
    for root in roots:
        for d in sorted(root.iterdir()):
            m = NAME.match(d.name)
            if m and (d / "metrics.jsonl").is_file():
                if d.name in seen:
                    raise SystemExit(f"run {d.name} is in both {seen[d.name]} and {root}: pass one of them")
                seen[d.name] = root
                out.append((m.group(1), m.group(2), int(m.group(3)), d / "metrics.jsonl"))
    return out


def load(
    roots: Path | list[Path],
    key: str = "val/reward_mean",
    *,
    rename: dict[str, str] | None = None,
    only: set[str] | None = None,
    upto: int | None = None,
) -> dict[str, dict[str, dict[int, Run]]]:
    """{"cpu"|"gpu": {label: {seed: Run}}} of every run directory under the roots (validations of `key`).

    only keeps the runs whose labels (as named on disk) it holds; rename maps a run's label to the one it is shown
    under (a variant that became the preset: `nft1-kl03` -> `nft`); upto reads each run's rows up to that step only.
    Two runs that land on one label and seed are refused."""
    rename = rename or {}
    runs: dict[str, dict[str, dict[int, Run]]] = {"cpu": defaultdict(dict), "gpu": defaultdict(dict)}
    origin: dict[tuple[str, str, int], str] = {}
    for kind, label, seed, path in _run_dirs(roots if isinstance(roots, list) else [roots]):
        if only is not None and label not in only:
            continue
        shown = rename.get(label, label)
        if (kind, shown, seed) in origin:
            raise SystemExit(
                f"runs {origin[kind, shown, seed]} and {path.parent} are both {shown} seed {seed}: "
                "rename one (--label OLD=NEW) or leave it out (--only)"
            )
        origin[kind, shown, seed] = str(path.parent)
        rows = read_metrics(path)
        run = Run.of([r for r in rows if r["step"] <= upto] if upto is not None else rows, key)
        if run.points:
            runs[kind][shown][seed] = run
    return runs


def _labels(pairs: list[str]) -> dict[str, str]:
    """--label OLD=NEW arguments as {OLD: NEW}; a malformed one is refused with the form it needs."""
    out = {}
    for p in pairs:
        old, sep, new = p.partition("=")
        if not (sep and NAME.match(f"gpu_{old}_s0") and NAME.match(f"gpu_{new}_s0")):
            raise SystemExit(f"--label {p!r}: give OLD=NEW, two run labels such as nft1-kl03=nft")
        out[old] = new
    return out


def _kept_row(r: dict) -> dict:
    return {k: v for k, v in r.items() if k in ("step", "time/total") or k.startswith("val/")}


def keep(roots: list[Path], dst: Path, only: set[str] | None = None) -> int:
    """Copy what the league reads of every run under the roots to dst/<run>/metrics.jsonl: per row its step and
    time/total, and the validation's keys (val/...). A few kB a run, so a record's runs can be kept beside it and
    read again with the runs of a later call. Only the labels in `only` (all when None) are copied, and a run that
    is already such a copy (an earlier record's) is not copied again. Returns the number of runs written."""
    n = 0
    for _, label, _, path in _run_dirs(roots):
        rows = read_metrics(path)
        if (only is not None and label not in only) or all(_kept_row(r) == r for r in rows):
            continue
        out = dst / path.parent.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(_kept_row(r)) + "\n" for r in rows))
        n += 1
    return n


def _mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def _hit(h: tuple[int, float] | None) -> str:
    return "never" if h is None else f"step {h[0]}, {h[1]:.0f} s"


def tables(runs: dict[str, dict[int, Run]], *, steps: int, drop: float, target: float) -> str:
    """The per-run table and the per-label summary, as markdown."""
    lines = [
        f"| run | seed | start | best (step) | final (step) | AUC | first ≥ {target} | worst fall after the best | held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            lines.append(
                f"| {label} | {seed} | {r.points[0][2]:.3f} | {r.best[1]:.3f} ({r.best[0]}) | "
                f"{r.final[1]:.3f} ({r.final[0]}) | {r.auc():.3f} | {_hit(r.first_at(target))} | "
                f"{r.worst_after_best():.3f} | {'yes' if r.held(steps, drop, target) else '**no**'} |"
            )
    lines += [
        "",
        f"| label | seeds | best | final | AUC | first ≥ {target} (step, s; per seed) | held |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, by_seed in runs.items():
        rs = [r for _, r in sorted(by_seed.items())]
        held = sum(r.held(steps, drop, target) for r in rs)
        hits = " / ".join("never" if (h := r.first_at(target)) is None else f"{h[0]}, {h[1]:.0f}" for r in rs)
        lines.append(
            f"| {label} | {len(rs)} | {_mean_std([r.best[1] for r in rs])} | {_mean_std([r.final[1] for r in rs])} | "
            f"{_mean_std([r.auc() for r in rs])} | {hits} | {held} of {len(rs)} |"
        )
    return "\n".join(lines)


def plot(
    runs: dict[str, dict[int, Run]],
    path: Path,
    *,
    target: float | None,
    title: str,
    ylabel: str = "held-out OCR (validation)",
) -> None:
    """All labels' curves: the mean over seeds and a band from the lowest to the highest seed where every seed
    has a validation; past that, the seeds that went on, thin; an x where a run stopped early."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    end = max(r.final[0] for by_seed in runs.values() for r in by_seed.values())
    for label, by_seed in runs.items():
        by_step: dict[int, list[float]] = defaultdict(list)
        for r in by_seed.values():
            for s, _, y in r.points:
                by_step[s].append(y)
        xs = [s for s in sorted(by_step) if len(by_step[s]) == len(by_seed)]
        mean = [statistics.mean(by_step[s]) for s in xs]
        (line,) = ax.plot(xs, mean, marker=".", label=f"{label} ({len(by_seed)} seeds)")
        color = line.get_color()
        ax.fill_between(
            xs, [min(by_step[s]) for s in xs], [max(by_step[s]) for s in xs], color=color, alpha=0.2
        )
        for r in by_seed.values():
            rest = [(s, y) for s, _, y in r.points if s >= xs[-1]]
            if len(rest) > 1:
                ax.plot([s for s, _ in rest], [y for _, y in rest], color=color, lw=0.8, alpha=0.7)
            if r.final[0] < end:
                ax.plot([r.final[0]], [r.final[1]], marker="x", color=color, ms=7)
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step (x: the run stopped there)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("roots", type=Path, nargs="+", help="directories holding the run directories")
    ap.add_argument("--steps", type=int, default=300, help="a run that held ran this many steps")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument(
        "--held-drop", type=float, default=0.03, help="the largest fall below the best that holds"
    )
    ap.add_argument("--plot", type=Path, default=None, help="write the GPU curves to this PNG")
    ap.add_argument(
        "--gold",
        nargs=2,
        metavar=("KEY", "PNG"),
        default=None,
        help="also plot a gold statistic of the GPU runs, e.g. val/gold/white_frac white.png",
    )
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="copy the rows the league reads of every run to this directory",
    )
    ap.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="show the runs labelled OLD as NEW (a variant that became the preset); repeatable",
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated labels (as on disk) to keep; the others are left out"
    )
    ap.add_argument(
        "--upto",
        type=int,
        default=None,
        help="read every run up to this step only, and judge 'held' there: runs cut short (a lost machine) "
        "against whole ones at the length all reached; a run that stopped before it still does not hold",
    )
    args = ap.parse_args(argv)
    if args.upto is not None:
        args.steps = args.upto
    pick = {"rename": _labels(args.label), "only": set(args.only.split(",")) if args.only else None}
    runs = load(args.roots, **pick, upto=args.upto)
    for kind in ("cpu", "gpu"):
        if runs[kind]:
            print(f"\n{kind.upper()} runs\n")
            print(tables(runs[kind], steps=args.steps, drop=args.held_drop, target=args.target))
    if args.plot and runs["gpu"]:
        plot(runs["gpu"], args.plot, target=args.target, title="text renderer, tiny-gpu presets")
        print(f"\nplot: {args.plot}")
    if args.gold:
        key, png = args.gold
        gold = load(args.roots, key, **pick, upto=args.upto)["gpu"]
        plot(gold, Path(png), target=None, title=f"text renderer, tiny-gpu presets: {key}", ylabel=key)
        print(f"plot: {png}")
    if args.keep:
        print(f"kept {keep(args.roots, args.keep, pick['only'])} runs' validation rows in {args.keep}")


if __name__ == "__main__":
    main()
