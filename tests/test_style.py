"""The code keeps the house style: ruff's lint and its formatter (``[tool.ruff]`` in pyproject.toml)
pass on the whole repository, notebooks included. To fix: ``ruff check --fix . && ruff format .``."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(args):
  out = subprocess.run([sys.executable, "-m", "ruff", *args, "."], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, f"ruff {' '.join(args)} failed:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
