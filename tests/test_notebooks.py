"""Execute every notebooks/*.ipynb: code cells in order, one namespace, cwd = notebooks/.

The cells are exec'd in this process (no Jupyter kernel needed). IPython-only lines (``%magic``,
``!shell``) are skipped. A failing cell reports the notebook, the cell number and its source.
"""
import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def _source(cell) -> str:
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else src
    return "\n".join(line for line in src.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def test_notebooks_exist():
    assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_runs(path, monkeypatch):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb.get("nbformat") == 4, f"{path.name}: not an nbformat 4 notebook"
    assert isinstance(nb.get("cells"), list) and nb["cells"], f"{path.name}: no cells"
    for cell in nb["cells"]:
        assert cell.get("cell_type") in ("code", "markdown", "raw"), cell.get("cell_type")
    try:
        import nbformat  # optional: full schema validation when it is installed
    except ImportError:
        pass
    else:
        nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))

    monkeypatch.chdir(path.parent)
    monkeypatch.setenv("MPLBACKEND", "Agg")    # never open a window
    monkeypatch.delenv("DISPLAY", raising=False)
    namespace = {"__name__": "__main__", "__file__": os.fspath(path)}
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code_cells, f"{path.name}: no code cells"
    for k, cell in enumerate(code_cells):
        src = _source(cell)
        try:
            exec(compile(src, f"{path.name}[code cell {k}]", "exec"), namespace)  # noqa: S102
        except Exception as e:
            pytest.fail(f"{path.name}: code cell {k} raised {type(e).__name__}: {e}\n"
                        f"--- cell source ---\n{src}", pytrace=True)
