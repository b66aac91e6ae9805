"""benchmarks/league.py on hand-made metrics files: best, final, AUC, first crossing, the held rule, the figure."""

import json
from pathlib import Path

import pytest

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _league():
    return load_script(ROOT / "benchmarks" / "league.py")


def _write(root: Path, name: str, scores: dict[int, float], step_s: float = 2.0) -> None:
    d = root / name
    d.mkdir(parents=True)
    rows = []
    for step in range(max(scores) + 1):
        # a run's rows hold more than what --keep copies
        row = {"step": step, "time/total": step_s, "train/loss": 0.0}
        if step in scores:
            row["val/reward_mean"] = scores[step]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_numbers_by_hand():
    """0.6, 0.9, 0.95, 0.93 at steps 0, 10, 20, 30: best 0.95 (20), final 0.93, AUC = (7.5 + 9.25 + 9.4) / 30,
    first >= 0.9 at step 10 after 11 steps of 2 s, worst fall after the best 0.02: held over 30 steps."""
    league = _league()
    run = league.Run.of(
        [
            {"step": s, "time/total": 2.0} | ({"val/reward_mean": y} if y else {})
            for s, y in enumerate([0.6] + [None] * 9 + [0.9] + [None] * 9 + [0.95] + [None] * 9 + [0.93])
        ]
    )
    assert run.best == (20, 0.95) and run.final == (30, 0.93)
    assert run.auc() == pytest.approx((10 * 0.75 + 10 * 0.925 + 10 * 0.94) / 30)
    assert run.first_at(0.9) == (10, 22.0)
    assert run.worst_after_best() == pytest.approx(0.02)
    assert run.held(30, 0.03, 0.9)
    assert not run.held(31, 0.03, 0.9)  # stopped before the end (e.g. by the collapse guard)
    assert not run.held(30, 0.01, 0.9)
    assert not run.held(30, 0.03, 0.94)


def test_tables_and_plot_over_a_directory(tmp_path, capsys):
    """A collapsing seed does not hold; the summary counts it; labels with a variant are read; the PNG is made."""
    league = _league()
    _write(tmp_path, "gpu_nft_s1", {0: 0.6, 10: 0.94, 20: 0.93})
    _write(tmp_path, "gpu_nft_s2", {0: 0.6, 10: 0.95, 20: 0.2})
    _write(tmp_path, "gpu_nft-decay1_s1", {0: 0.6, 10: 0.91, 20: 0.92})
    (tmp_path / "not_a_run").mkdir()
    league.main([str(tmp_path), "--steps", "20", "--plot", str(tmp_path / "league.png")])
    out = capsys.readouterr().out
    assert "| nft | 2 |" in out and "1 of 2 |" in out
    assert "| nft-decay1 | 1 |" in out and "| nft | 2 | 0.945 ± 0.007 |" in out
    assert (tmp_path / "league.png").stat().st_size > 1000


def test_kept_rows_give_the_same_league_and_two_roots_combine(tmp_path, capsys):
    """--keep writes only step, time/total and val/ keys; the league over the kept copy prints the same tables as
    over the runs; runs of two directories make one league, and the same run in both is refused."""
    league = _league()
    a, b, kept = tmp_path / "a", tmp_path / "b", tmp_path / "kept"
    _write(a, "gpu_nft_s1", {0: 0.6, 10: 0.94, 20: 0.93})
    rows = (a / "gpu_nft_s1" / "metrics.jsonl").read_text().splitlines()
    rows[5] = json.dumps(json.loads(rows[5]) | {"train/loss": 1.5, "val/gold/white_frac": 0.1})
    (a / "gpu_nft_s1" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    _write(b, "gpu_grpo_s1", {0: 0.6, 10: 0.97, 20: 0.96})
    league.main([str(a), "--steps", "20", "--keep", str(kept)])
    before = capsys.readouterr().out
    kept_rows = [json.loads(x) for x in (kept / "gpu_nft_s1" / "metrics.jsonl").read_text().splitlines()]
    assert kept_rows[5] == {"step": 5, "time/total": 2.0, "val/gold/white_frac": 0.1}
    league.main([str(kept), "--steps", "20"])
    assert capsys.readouterr().out == before.replace(f"\nkept 1 runs' validation rows in {kept}\n", "\n")
    league.main([str(kept), str(b), "--steps", "20"])
    out = capsys.readouterr().out
    assert "| nft | 1 |" in out and "| grpo | 1 | 0.970 |" in out
    with pytest.raises(SystemExit, match="gpu_nft_s1 is in both"):
        league.main([str(kept), str(a)])


def test_labels_rename_and_select_runs_and_a_clash_is_refused(tmp_path, capsys):
    """--label shows a variant's runs under its preset's label, --only keeps the labels named on disk, and two runs
    that would become one label and seed are refused rather than one silently replacing the other."""
    league = _league()
    _write(tmp_path, "gpu_nft1-kl03_s1", {0: 0.6, 10: 0.94, 20: 0.93})
    _write(tmp_path, "gpu_awm-p1_s1", {0: 0.6, 10: 0.8, 20: 0.5})
    _write(tmp_path, "gpu_grpo_s1", {0: 0.6, 10: 0.97, 20: 0.96})
    league.main([str(tmp_path), "--steps", "20", "--label", "nft1-kl03=nft", "--only", "nft1-kl03,grpo"])
    out = capsys.readouterr().out
    assert "| nft | 1 | 0.940 |" in out and "| grpo | 1 | 0.970 |" in out
    assert "nft1-kl03" not in out and "awm-p1" not in out
    _write(tmp_path, "gpu_nft_s1", {0: 0.6, 10: 0.9, 20: 0.9})
    with pytest.raises(SystemExit, match="both nft seed 1"):
        league.main([str(tmp_path), "--label", "nft1-kl03=nft"])
    with pytest.raises(SystemExit, match="give OLD=NEW"):
        league.main([str(tmp_path), "--label", "nft"])


def test_keep_copies_only_the_selected_runs_and_not_those_already_kept(tmp_path, capsys):
    """--keep with --only copies the selected labels alone; the runs of an earlier kept directory join the league
    but are not copied a second time."""
    league = _league()
    runs, stored = tmp_path / "runs", tmp_path / "league_runs"
    _write(runs, "gpu_grpo_s1", {0: 0.6, 10: 0.97, 20: 0.96})
    _write(runs, "gpu_awm-p1_s1", {0: 0.6, 10: 0.8, 20: 0.5})
    _write(tmp_path / "raw", "gpu_nft_s2", {0: 0.6, 10: 0.94, 20: 0.93})
    league.main([str(tmp_path / "raw"), "--keep", str(stored / "old")])
    new = stored / "new"
    league.main([str(runs), str(stored / "old"), "--steps", "20", "--only", "grpo,nft", "--keep", str(new)])
    out = capsys.readouterr().out
    assert "| nft | 1 |" in out and "| grpo | 1 |" in out and f"kept 1 runs' validation rows in {new}" in out
    assert sorted(p.name for p in new.iterdir()) == ["gpu_grpo_s1"]


def test_upto_compares_a_cut_run_with_whole_ones_at_the_common_length(tmp_path, capsys):
    """--upto 20 reads every run to step 20: the whole run (0.6, 0.9, 0.95 | 0.7 at 30) is judged on 0.6, 0.9, 0.95
    (best 0.95, final 0.95, AUC (7.5 + 9.25) / 20, held at 20) and its fall at step 30 is not seen; the run cut at
    step 20 holds there too; one that stopped at 10 does not. Without --upto the cut runs do not hold at 30."""
    league = _league()
    _write(tmp_path, "gpu_grpo_s1", {0: 0.6, 10: 0.9, 20: 0.95, 30: 0.7})
    _write(tmp_path, "gpu_grpo-fp8_s1", {0: 0.6, 10: 0.92, 20: 0.94})
    _write(tmp_path, "gpu_awm_s1", {0: 0.6, 10: 0.92})
    league.main([str(tmp_path), "--upto", "20"])
    out = capsys.readouterr().out
    auc = (10 * 0.75 + 10 * 0.925) / 20
    assert f"| grpo | 1 | 0.600 | 0.950 (20) | 0.950 (20) | {auc:.3f} |" in out
    assert "| grpo | 1 | 0.950 | 0.950 | " in out and out.count("1 of 1 |") == 2 and "| awm | 1 |" in out
    assert "0 of 1 |" in out
    league.main([str(tmp_path), "--steps", "30"])
    out = capsys.readouterr().out
    assert "| grpo | 1 | 0.600 | 0.950 (20) | 0.700 (30) |" in out and out.count("0 of 1 |") == 3
