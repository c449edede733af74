"""The notebooks run headless (nbclient, the venv's python3 kernel) so they never rot."""

import os
import uuid
from pathlib import Path

import pytest

from sgl_tts.env_names import NOTEBOOK_MODEL, NOTEBOOK_TAG, read
from sgl_tts.testing import processes_with_env

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def outputs_text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.runtime
def test_quickstart_runs_headless_and_shows_tree_and_plot(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    tag = uuid.uuid4().hex
    monkeypatch.setenv(NOTEBOOK_MODEL, read(NOTEBOOK_MODEL) or "tiny-random")
    monkeypatch.setenv(NOTEBOOK_TAG, tag)
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=900,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()  # raises CellExecutionError naming the cell if any cell fails
    finally:
        leftovers = processes_with_env(NOTEBOOK_TAG, tag)
        for pid in leftovers:  # only processes this test's kernel started
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    cells = {cell.metadata.get("tags", [None])[0]: cell for cell in notebook.cells if cell.cell_type == "code"}
    assert "ready at http://127.0.0.1:" in outputs_text(cells["setup"])
    run_text = outputs_text(cells["run"])
    assert "gold: 7 | answer:" in run_text and "generated_tokens" in run_text
    tree_text = outputs_text(cells["tree"]).splitlines()
    summary = tree_text[-1]
    nodes = int(summary.split(" nodes")[0])
    assert nodes >= 4 and len(tree_text) - 1 == nodes, "one printed line per tree node"
    assert tree_text[0].endswith("(prompt)") and sum(line.count("*") for line in tree_text[1:-1]) >= 1
    images = [o for o in cells["plot"].outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1, "the tree plot is displayed"
    assert "runtime stopped" in outputs_text(cells["cleanup"])
    assert not leftovers, f"the notebook left runtime processes behind: {leftovers}"
