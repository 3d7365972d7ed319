"""The tree passes ruff as pyproject.toml configures it (every module, test and benchmark parses, and none has an
unused import, an undefined name or a line past 120 characters), and the package passes mypy as it configures it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_tree_passes_ruff():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_the_package_passes_mypy():
    res = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT)  # (pyproject.toml)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
