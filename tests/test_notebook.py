"""The example notebook runs top to bottom on this interpreter's kernel and shows its drawings."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from fxnx import _drawing as dr

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("torchvision")

NOTEBOOK = Path(__file__).parent.parent / "examples" / "tour.ipynb"


def _kernel(tmp_path: Path, monkeypatch) -> str:
    """A kernelspec, found first, that runs this very interpreter (the venv's python)."""
    spec = tmp_path / "jupyter" / "kernels" / "fxnx-tour"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fxnx tour", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "fxnx-tour"


def execute(path: Path, out: Path, kernel: str, cwd: Path) -> nbformat.NotebookNode:
    """Run every cell of the notebook at ``path`` (an error in any fails), write the executed
    copy to ``out`` and return it."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=300,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    nbformat.write(nb, out)
    return nb


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.skipif(dr.graphviz.shutil.which("dot") is None, reason="Graphviz dot not installed")
def test_the_notebook_runs_and_shows_its_drawings(tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, tmp_path / "tour.ipynb", _kernel(tmp_path, monkeypatch), tmp_path)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(out.get("output_type") != "error" for cell in code for out in cell.outputs)
    shown = {}  # each cell's source to the data of its result
    for cell in code:
        for out in cell.outputs:
            if out.get("output_type") == "execute_result":
                shown[cell.source] = out["data"]
    first = shown[code[0].source]
    assert "fxnx graph" in first["text/plain"] and "<table>" in first["text/html"]

    def value(start):
        (source,) = [s for s in shown if s.startswith(start)]
        return ast.literal_eval(shown[source]["text/plain"])

    # Hand counts for ResNet-18 (the README's): 2^8 paths, 24 dominators, 18 and 5 layers.
    assert value("paths = {}") == (256, 256)
    assert value("idom = ")[0] == 24
    assert value("longest = ") == [18, 5]
    drawings = [data for source, data in shown.items() if source.startswith("fxnx.draw(")]
    assert len(drawings) == 3
    for data in drawings:
        assert "image/svg+xml" in data and data["image/svg+xml"].lstrip().startswith("<?xml")
        assert "fxnx.Drawing" in data["text/plain"]
