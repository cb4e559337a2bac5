"""`pdtool ARGS` called in this process (`pdtool.cli.main`, what the console script runs), with
its exit status and output captured as a finished process would give them: the quick way to
test a command that starts no deployment."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Mapping
from unittest import mock

from pdtool.cli import main


def run_cli(*args: str, env: Mapping[str, str] | None = None,
            clear: bool = False) -> subprocess.CompletedProcess[str]:
    """The command's exit status, stdout and stderr; `env` is added to the environment for
    the call (`clear`: it replaces it). Tables are as wide as a 200-column terminal's."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "200", **(env or {})}, clear=clear), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help, usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["pdtool", *args], code, out.getvalue(), err.getvalue())
