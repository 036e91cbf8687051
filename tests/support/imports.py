"""What a real tfdp process imports: the check that commands which need no TensorFlow do not load it."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def imported_modules(*args: str, module: bool = True, timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                                     set[str]]:
    """Runs `python -X importtime -m tfdp ARGS` (or `python -X importtime ARGS`); (result, every module imported).
    The result's stderr is the process's own, the importtime lines left out.

    importtime writes each import as it happens, so even a process that ends
    with os._exit (as a `UserError` does) reports all of them.
    """
    command = [sys.executable, "-X", "importtime", *(["-m", "tfdp"] if module else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = result.stderr.splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:") and "|" in line}
    own = "".join(line + "\n" for line in lines if not line.startswith("import time:"))
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout, own), modules


def heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in ("tensorflow", "keras")}
