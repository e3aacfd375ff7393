"""The notebooks under notebooks/ run top to bottom on the CPU (nbclient, a fresh kernel each).

Outputs are not committed: each notebook asserts what it shows, so an error in any cell fails here.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_every_notebook_is_collected():
  assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{path.name}: commit it without outputs"
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
  images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert images or "plot" not in path.read_text(), path.name
