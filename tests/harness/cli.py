"""The ``gpuckpt`` CLI as the tests run it: in this process through typer's runner
(:func:`invoke`), or as the user's shell runs it, a subprocess (:func:`cli`)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typer.testing import Result

#: argv that runs the CLI as its console script does
CLI = (sys.executable, "-m", "cli.main")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``gpuckpt ARGS`` in a subprocess, with this process's environment; its output captured."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def invoke(*args: str) -> Result:
    """``gpuckpt ARGS`` in this process (typer's ``CliRunner``): stdout and stderr apart."""
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(app, list(args))
