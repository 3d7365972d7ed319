"""Benchmark cases in fresh processes: the parent runs `script` again with a case's arguments, and the child prints
its result as one JSON line after RESULT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: str, argv: list[str], timeout: float) -> dict:
    """`script` run with `argv` in a fresh interpreter (the checkout's tieredkv first on the path); its RESULT."""
    done = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{Path(script).name} {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def report(result: dict) -> None:
    """The child's side: its result, for run_child."""
    print("RESULT " + json.dumps(result), flush=True)


def save(result: dict, path: str | None) -> dict:
    """The parent's side: `result` written to `path` as JSON (where one is given); returns it."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    return result
