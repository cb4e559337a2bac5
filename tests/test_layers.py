"""The layer rules of docs/architecture.md, as import contracts (pyproject.toml,
[tool.importlinter]) checked by import-linter over every import, lazy ones included:
`transfer` never imports `pdtool`; the messenger's and the SGLang backend's control planes do
not import each other; the shared data plane (`transfer.plane`) imports neither of them
nor the wire; config, rules, plan and memory import no launch, engine, command or load
code (they are pure functions of the config). The C binding's files call each other without a
circle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold():
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command;"
                          " lint_imports_command()"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


def _c_calls() -> dict[str, set[str]]:
    """For each C file of the binding, the other C files whose functions it calls."""
    import re

    files = sorted((ROOT / "transfer" / "csrc").glob("*.c"))
    text = {f.name: f.read_text() for f in files}
    defined = {name: f for f, src in text.items()
               for name in re.findall(r"^[a-z][\w \*]*?\b(pd_\w+)\([^;]*?\{", src, re.M | re.S)}
    return {f: {defined[c] for c in re.findall(r"\b(pd_\w+)\(", src)
                if c in defined and defined[c] != f}
            for f, src in text.items()}


def test_the_c_files_call_each_other_without_a_circle():
    """The C binding's files form layers too: a file never calls into a file that calls back
    into it, directly or around a longer circle."""
    calls = _c_calls()
    assert calls["util.c"] == set(), calls["util.c"]  # the leaf: clock, sleep lengths, errors
    state: dict[str, int] = {}

    def visit(f: str, path: list[str]) -> None:
        if state.get(f) == 2:
            return
        assert state.get(f) != 1, "circle: " + " -> ".join([*path, f])
        state[f] = 1
        for g in sorted(calls[f]):
            visit(g, [*path, f])
        state[f] = 2

    for f in sorted(calls):
        visit(f, [])


def test_test_modules_share_code_through_helpers_only():
    """What tests share lives in tests/helpers/; a test module never imports another one (a
    test module used as a library runs its module-level set-up, and its fixtures and markers,
    wherever it is imported)."""
    import ast

    tests = ROOT / "tests"
    found = []
    for path in sorted([*tests.glob("*.py"), *(tests / "helpers").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n.split(".")[0].startswith("test_")]
    assert found == []
