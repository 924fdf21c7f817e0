"""The package's shape, kept true: no import cycle, functions and classes a reader can hold in mind,
the static checks (ruff, mypy, deptry, import-linter) passing. STYLE.md, rule 14."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchspec"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300

# Today's functions and classes over the limits, with their size when this list was written. An
# entry may only shrink: growing one fails, and one that fits the limit must leave the list.
OVER_LIMIT: dict[str, int] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, at any depth in the file (lazy imports count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import x` names a module; `from .m import f` names m.
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules] or [base]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t != "batchspec":
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    modules = _modules()
    # A package's __init__ that only hands names on lazily (engine/__init__.py) is not an edge.
    graph = {n: _imports(n, p, modules) - {"batchspec.engine"} for n, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _sizes() -> dict[str, tuple[int, int]]:
    """file:name -> (lines, its limit), for every function and class; a name defined more than
    once in a file (methods of different classes) keeps its longest."""
    sizes: dict[str, tuple[int, int]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                key = f"{rel}:{node.name}"
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                sizes[key] = max(sizes.get(key, (0, limit)), (node.end_lineno - node.lineno + 1, limit))
    return sizes


def test_functions_and_classes_fit_in_a_readers_head():
    over, grown, fixed = [], [], []
    for key, (lines, limit) in _sizes().items():
        if lines <= limit:
            if key in OVER_LIMIT:
                fixed.append(key)
            continue
        if key not in OVER_LIMIT:
            over.append(f"{key}: {lines} lines (limit {limit})")
        elif lines > OVER_LIMIT[key]:
            grown.append(f"{key}: {lines} lines, was {OVER_LIMIT[key]}")
    assert not over, "over the limit; split by stage (STYLE.md 14)"
    assert not grown, "an allowed oversize grew"
    assert not fixed, "now within the limit: take it off OVER_LIMIT"


RUNNER_MODULE_LINES = 170  # issue 38: the runner as stages, each a module of ~150 lines with one job


def test_each_runner_stage_is_a_module_a_reader_can_hold():
    """runner/ is split by stage (read, plan, run, commit) and by concern within a stage; a module
    that grows past the limit has taken on a second job (STYLE.md 14)."""
    long = {p.name: n for p in (PACKAGE / "runner").glob("*.py")
            if (n := len(p.read_text().splitlines())) > RUNNER_MODULE_LINES}
    assert not long, f"runner modules over {RUNNER_MODULE_LINES} lines: {long}"


def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("command", [
    ["ruff", "check", "batchspec", "tests", "scripts", "examples"],
    ["mypy"],
    ["deptry", "."],
    ["lint-imports"],
], ids=lambda c: c[0])
def test_static_check_passes(command):
    done = subprocess.run([_tool(command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_module_is_excused_from_mypy():
    """Every module passes mypy's default checks (the strict ones on the seam and the policy):
    none is on an ignore_errors list, and none skips the check file-wide."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    excused = [o["module"] for o in config.get("overrides", []) if o.get("ignore_errors")]
    assert not excused and not config.get("ignore_errors"), f"modules excused from mypy: {excused}"
    skipped = [p.relative_to(ROOT) for p in (ROOT / "batchspec").rglob("*.py") if "# mypy: ignore-errors" in p.read_text()]
    assert not skipped, f"files that skip mypy: {skipped}"


def test_docs_draft_kind_table_is_the_registry():
    from batchspec.draft_kinds import markdown_table

    page = (ROOT / "docs" / "engine.md").read_text()
    between = page.split("<!-- draft-kinds:start -->\n")[1].split("\n<!-- draft-kinds:end -->")[0]
    assert between == markdown_table(), "regenerate docs/engine.md's table from batchspec/draft_kinds.markdown_table()"
