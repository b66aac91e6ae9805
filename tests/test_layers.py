"""The import layers of src/fgrpo: every import points down (or sideways within a layer), the import graph has no
cycle, and no fgrpo import hides inside a function. Read from the source with `ast`, nothing is imported."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Lowest first. A module's layer is that of the longest name here that is it or one of its packages; a module
# may import its own layer and those below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("fgrpo", "fgrpo.errors", "fgrpo.fonts", "fgrpo.core", "fgrpo.scripts")),
    ("config", ("fgrpo.config",)),
    ("runtime", ("fgrpo.parallel", "fgrpo.logging", "fgrpo.guard", "fgrpo.checkpoint", "fgrpo.files")),
    ("models", ("fgrpo.models",)),
    ("rewards/policy", ("fgrpo.rewards", "fgrpo.policy")),
    ("rollout/data", ("fgrpo.rollout", "fgrpo.data")),
    ("algorithms", ("fgrpo.algorithms", "fgrpo.recompute", "fgrpo.presets", "fgrpo.evaluate")),
    ("train", ("fgrpo.train", "fgrpo.async_mode", "fgrpo.runs")),
]


def layer_of(module: str) -> int:
    best, layer = "", -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, layer = name, i
    assert layer >= 0, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return layer


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fgrpo_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported fgrpo module, line, inside a function) for every fgrpo import of the file, TYPE_CHECKING ones
    included. `from fgrpo.x import y` counts as an import of fgrpo.x.y where that is a module, else of fgrpo.x."""
    tree = ast.parse(path.read_text(), str(path))
    local: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            local |= {id(n) for n in ast.walk(fn) if n is not fn}
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # a relative import names its module from this file's package
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
            base = base if node.level else node.module or ""
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        found += [
            (n, node.lineno, id(node) in local) for n in names if n == "fgrpo" or n.startswith("fgrpo.")
        ]
    return found


def _is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    return {module_name(p): fgrpo_imports(p) for p in sorted((SRC / "fgrpo").rglob("*.py"))}


def test_no_import_points_up_a_layer():
    up = [
        f"{m}:{line} ({LAYERS[layer_of(m)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for m, imports in graph().items()
        for target, line, _ in imports
        if layer_of(target) > layer_of(m)
    ]
    assert not up, "\n".join(up)


def test_the_import_graph_has_no_cycle():
    edges = {m: sorted({t for t, _, _ in imports if t != m}) for m, imports in graph().items()}
    done: set[str] = set()
    cycles = []

    def visit(m: str, path: list[str]) -> None:  # depth first; `path` ends with m
        for t in edges.get(m, []):
            if t in path:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in done:
                visit(t, path + [t])
        done.add(m)

    for m in sorted(edges):
        if m not in done:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_fgrpo_import_inside_a_function():
    hidden = sorted(
        {f"{m}:{line} imports {t}" for m, imports in graph().items() for t, line, inside in imports if inside}
    )
    assert not hidden, "\n".join(hidden)


def test_every_module_has_a_layer():
    for m in graph():
        layer_of(m)


def test_scripts_are_leaves():
    """Experiment and benchmark files are read only through fgrpo.scripts (one loader by path), and no file imports
    an experiment file as a module: what two scripts share lives in the package."""
    root = SRC.parent
    experiments = {p.stem for p in (root / "experiments").glob("*.py")}
    loaders, imports = [], []
    for folder in ("src", "benchmarks", "tests", "experiments"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            if "spec_from_file_location" in text and path not in (
                SRC / "fgrpo" / "scripts.py",
                Path(__file__),
            ):
                loaders.append(str(path.relative_to(root)))
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = (
                        [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    )
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    imports += [f"{where} imports {n}" for n in names if n in experiments]
    assert not loaders, f"load scripts with fgrpo.scripts.load_script, not by hand: {loaders}"
    assert not imports, "\n".join(imports)
