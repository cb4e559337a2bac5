"""The markers of tests/conftest.py cover every test module that imports what they stand for, so
`pytest -m "not fabric"` / `-m "not sglang"` really leave out what needs libfabric / SGLang."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import MODULE_MARKS

TESTS = Path(__file__).resolve().parent
#: the marker a top-level import implies (a module prefix, dotted)
NEEDS = {
    "fabric": ("transfer.fabric", "transfer.messenger", "transfer.testing", "transfer.staging",
               "transfer.sglang"),
    "sglang": ("sglang", "sglang_router", "transfer.sglang"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:  # module level: what collection imports
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_every_module_importing_a_marked_part_carries_the_marker():
    missing = []
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        marks = set(MODULE_MARKS.get(path.stem, ()))
        imported = _imports(path)
        for mark, prefixes in NEEDS.items():
            needed = any(n == p or n.startswith(p + ".") for n in imported for p in prefixes)
            if needed and mark not in marks and f"pytest.mark.{mark}" not in text:
                missing.append(f"{path.name}: {mark}")
    assert not missing, f"add these to MODULE_MARKS in tests/conftest.py: {missing}"


def test_marked_modules_exist():
    assert {p.stem for p in TESTS.glob("test_*.py")} >= set(MODULE_MARKS)
