"""The docs a newcomer reads stay short and true: the README fits its budget, RESULTS.md's current table fits one
screen, every relative link lands on a file (and anchor), and every experiment command names a real preset."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [README, RESULTS, *DOCS]

README_MAX_LINES = 150
TABLE_MAX_ROWS = 25
CELL_MAX_CHARS = 160

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# `experiments/<file>.py <preset>`, or the bare file name where it is an experiment's
COMMAND = re.compile(r"(?<![\w/.-])(experiments/)?([A-Za-z0-9_]+)\.py[ \t]+([a-z][a-z0-9-]*)(?![\w/-])")
COPY = re.compile(r"\bcp\s+experiments/([A-Za-z0-9_]+)\.py\s+experiments/([A-Za-z0-9_]+)\.py")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Explicit `<a id=...>` anchors and heading anchors (GitHub numbers repeated headings -1, -2, ...)."""
    text = FENCE.sub("", path.read_text())
    out = set(ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for h in HEADING.findall(text):
        s = slug(h)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file, or anchor inside a markdown file, does not exist."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{rel(path)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(path)}: {target} (no anchor #{anchor} in {dest.name})")
    return bad


def current_table(text: str) -> list[list[str]]:
    """Cells of the data rows of RESULTS.md's table under "## Current numbers" (header and separator dropped)."""
    m = re.search(r"^## Current numbers\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "RESULTS.md has no '## Current numbers' section"
    lines = [ln.strip() for ln in m.group(1).splitlines() if ln.strip().startswith("|")]
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip("|"))] for ln in lines]
    return [r for r in rows[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]


@cache
def experiment_presets(stem: str) -> frozenset[str] | None:
    """The preset (subcommand) names of experiments/<stem>.py: its `presets()` where it has one, and the keys of
    any `{"name": ("help", config)}` dict in its `__main__` block. None: no such experiment file."""
    path = ROOT / "experiments" / f"{stem}.py"
    if not path.is_file():
        return None
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict) or not node.keys:
            continue
        keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        if len(keys) == len(node.keys) and all(
            isinstance(v, ast.Tuple) and len(v.elts) == 2 for v in node.values
        ):
            names.update(keys)
    if re.search(r"^def presets\(", path.read_text(), re.M):
        names.update(load_script(path).presets())
    return frozenset(names)


def bad_commands(path: Path) -> list[str]:
    """`experiments/<file>.py <preset>` mentions whose file or preset does not exist. A file made by
    `cp experiments/a.py experiments/b.py` in the same page stands for a.py."""
    text = path.read_text()
    copies = dict((new, old) for old, new in COPY.findall(text))
    bad = []
    for prefix, stem, preset in COMMAND.findall(text):
        presets = experiment_presets(copies.get(stem, stem))
        if presets is None:
            if prefix:
                bad.append(f"{rel(path)}: experiments/{stem}.py does not exist")
            continue  # a bare benchmark or library file name, not an experiment
        if preset not in presets:
            bad.append(f"{rel(path)}: {stem}.py {preset} (presets: {', '.join(sorted(presets))})")
    return bad


def test_readme_fits_its_budget():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines; keep it at most {README_MAX_LINES} (move detail to docs/)"
    )


def test_results_current_table_fits_one_screen():
    rows = current_table(RESULTS.read_text())
    assert 0 < len(rows) <= TABLE_MAX_ROWS, f"{len(rows)} rows; keep at most {TABLE_MAX_ROWS} (merge rows)"


def test_results_current_table_cells_are_short():
    rows = current_table(RESULTS.read_text())
    long = [
        (i + 1, j + 1, len(c)) for i, r in enumerate(rows) for j, c in enumerate(r) if len(c) > CELL_MAX_CHARS
    ]
    assert not long, (
        f"cells over {CELL_MAX_CHARS} chars (row, column, length): {long}; move detail to the record"
    )


@pytest.mark.parametrize("path", LINKED, ids=rel)
def test_relative_links_resolve(path: Path):
    assert not broken_links(path)


@pytest.mark.parametrize("path", [README, *DOCS], ids=rel)
def test_experiment_commands_name_real_presets(path: Path):
    assert not bad_commands(path)


def test_the_checks_catch_what_they_guard(tmp_path: Path):
    """Each checker flags a bad page, so the tests above cannot pass vacuously."""
    (tmp_path / "target.md").write_text('<a id="kept"></a>\n# A Heading, with `code`\n')
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#kept) [ok](target.md#a-heading-with-code) [ok](https://x.org/y) [ok](#kept-not)\n"
        "[gone](missing.md) [bad anchor](target.md#nope) `[in code](missing2.md)`\n"
    )
    assert broken_links(page) == [
        f"{page}: #kept-not (no anchor #kept-not in page.md)",
        f"{page}: missing.md (no such file)",
        f"{page}: target.md#nope (no anchor #nope in target.md)",
    ]
    table = "## Current numbers\n\n| a | b |\n|---|---|\n" + "| x | y |\n" * 26 + "\n## Records\n| z | z |\n"
    assert len(current_table(table)) == 26
    assert current_table("## Current numbers\n| a | b \\| c |\n|---|---|\n| 1 | 2 |\n") == [["1", "2"]]
    page.write_text(
        "uv run python experiments/qwen_image_ocr.py tiny-gpu --seed 1; experiments/qwen_image_ocr.py tinyy\n"
        "experiments/nope.py tiny; benchmarks/train_step.py --compile; sd35_ocr.py tiny-random\n"
        "cp experiments/sd35_ocr.py experiments/sd35_mine.py; experiments/sd35_mine.py tiny-gpu\n"
    )
    assert [b.split(": ", 1)[1] for b in bad_commands(page)] == [
        f"qwen_image_ocr.py tinyy (presets: {', '.join(sorted(experiment_presets('qwen_image_ocr') or ()))})",
        "experiments/nope.py does not exist",
    ]


def test_main_job_figure_builds_from_a_run_directory(tmp_path: Path):
    """The README's figure script reads a run's metrics.jsonl and first/last validation grids, and refuses a run
    without validations in one line naming the file."""
    import json

    from PIL import Image

    from fgrpo.errors import MissingFileError

    figure = load_script(ROOT / "benchmarks" / "main_job_figure.py")
    run = tmp_path / "run"
    (run / "images").mkdir(parents=True)
    rows = [{"step": 0, "reward/mean": 0.5, "val/reward_mean": 0.6}, {"step": 1, "reward/mean": 0.55}]
    rows.append({"step": 2, "reward/mean": 0.7, "val/reward_mean": 0.8})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, shade in ((0, 40), (2, 200)):
        Image.new("RGB", (64, 32), (shade,) * 3).save(run / "images" / f"val_{step:06d}.png")
    out = figure.build(run, tmp_path / "fig.png", dpi=30)
    assert Image.open(out).size[0] > 0
    assert figure.series(rows, "val/reward_mean") == ([0, 2], [0.6, 0.8])
    (run / "images" / "val_000002.png").unlink()
    with pytest.raises(MissingFileError, match="val_000002.png is missing"):
        figure.build(run, tmp_path / "fig2.png")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    with pytest.raises(MissingFileError, match="no val/reward_mean row"):
        figure.build(run, tmp_path / "fig3.png")
