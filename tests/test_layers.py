"""The layer rules of docs/architecture.md, as import contracts (pyproject.toml,
[tool.importlinter]) checked by import-linter over every import, lazy ones included:
`transfer` never imports `pdtool`; the messenger's and the SGLang backend's control planes do
not import each other; the shared data plane (`transfer.plane`) imports neither of them
nor the wire; config, rules, plan and memory import no launch, engine, command or load
code (they are pure functions of the config)."""

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
