"""The budgets a reader relies on (issue 63), checked so that the next feature cannot
quietly break them: no import cycle inside the package, `generate` free of eval/,
trainer.py and every function short, the two curated docs short."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagletools"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every module each module imports, lazy and TYPE_CHECKING imports included."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[mod] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = package[: len(package) - node.level + 1]
                    base = ".".join(stem + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in mods:
                        edges[mod].add(full)
                    elif base in mods:
                        edges[mod].add(base)
    return edges


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_package_has_no_import_cycle():
    edges = _imports(_modules())
    cycles = sorted(m for m in edges if m in _reachable(edges, m))
    assert not cycles, f"modules that import themselves through others: {cycles}"


def test_generate_imports_nothing_from_eval():
    edges = _imports(_modules())
    reached = _reachable(edges, "eagletools.commands.generate")
    assert not [m for m in reached if m.startswith("eagletools.eval")], sorted(reached)


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    """A Triton kernel (jitted lazily, kernels.dispatch.lazy_jit) takes `tl.constexpr`s."""
    args = [*node.args.args, *node.args.kwonlyargs]
    return any(a.annotation is not None and "constexpr" in ast.unparse(a.annotation) for a in args)


def test_no_function_over_80_lines_outside_triton_kernels():
    long = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80 and not _is_triton_kernel(node):
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines})")
    assert not long, long


def test_the_files_a_reader_holds_stay_short():
    budgets = {
        "eagletools/train/trainer.py": 600,
        "docs/results.md": 300,
        "docs/recipes.md": 300,
    }
    over = {
        name: n
        for name, limit in budgets.items()
        if (n := len((ROOT / name).read_text().splitlines())) >= limit
    }
    assert not over, f"over budget (lines): {over}"
