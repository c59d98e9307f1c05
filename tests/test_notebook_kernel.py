"""Notebooks executed in a real Jupyter kernel (nbclient): figures and the dashboard show as images with no setup
cell, and a kernel interrupt during training stops the cells queued after it."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from conftest import ROOT, SMALL_MODEL  # noqa: E402

SMALL = SMALL_MODEL + ["training.seq_len=32", "training.batch_size=2", "training.log_every=1", "training.eval_every=2"]


def notebook(*sources) -> "nbformat.NotebookNode":
    "A notebook of code cells, with the kernelspec a fresh JupyterLab notebook gets."
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    return nb


def client(nb, cwd, timeout=120):
    return nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )


def mimes(cell) -> list:
    return [m for o in cell.outputs for m in o.get("data", {})]


def stderr(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")


def test_figures_and_dashboard_show_as_png(tmp_path, features_run):
    "A finished run's figures (conftest's run, trained once for the plot tests) and a live dashboard, in a kernel."
    run, dash_run = features_run, tmp_path / "dash"
    nb = notebook(
        f"from cipher_nb.viz.plots import run_figures\nrun_figures({str(run)!r})['training']",
        f"from cipher_nb.viz.plots import run_figures\nrun_figures({str(run)!r})['routing']",
        # the live dashboard in a kernel: a widget while it trains, a static PNG of the final frame after
        "import warnings\n"
        "from cipher_nb.config.load import load_config\n"
        "from cipher_nb.monitor.health import HealthWarning\n"
        "from cipher_nb.train.builder import build_trainer\n"
        "from cipher_nb.viz.dashboard import LiveDashboard\n"
        "dash = LiveDashboard()\n"
        "warnings.simplefilter('ignore', HealthWarning)\n"
        f"cfg = load_config(None, {SMALL + ['schedule.max_steps=4', 'schedule.warmup_steps=1']!r})\n"
        f"build_trainer(cfg, {str(dash_run)!r}, callbacks=[dash], progress=False).fit(progress=False)\n"
        "dash.widget, dash.draws",
    )
    client(nb, tmp_path).execute()
    for cell in nb.cells[:2]:
        assert "image/png" in mimes(cell), cell.outputs  # not '<Figure size ... with 4 Axes>'
        assert not stderr(cell), stderr(cell)
    dash = nb.cells[2]
    assert not stderr(dash), stderr(dash)
    assert dash.outputs[-1]["data"]["text/plain"].startswith("(True, "), dash.outputs  # drawn as a widget
    shown = [o for o in dash.outputs if o["output_type"] == "display_data"]
    assert shown and "image/png" in shown[0]["data"], shown  # the widget was replaced by the final frame
    assert "application/vnd.jupyter.widget-view+json" not in shown[0]["data"]


def test_interrupt_stops_the_queued_cells(tmp_path):
    "A kernel interrupt during fit: an emergency checkpoint, then KeyboardInterrupt, so the next cell never runs."
    run, marker = tmp_path / "run", tmp_path / "second_cell_ran"
    overrides = SMALL + ["schedule.max_steps=20000", "training.checkpoint_every=100000", "training.eval_every=100000"]
    nb = notebook(
        "import warnings\n"
        "from cipher_nb.config.load import load_config\n"
        "from cipher_nb.monitor.health import HealthWarning\n"
        "from cipher_nb.train.builder import build_trainer\n"
        "warnings.simplefilter('ignore', HealthWarning)\n"
        f"build_trainer(load_config(None, {overrides!r}), {str(run)!r}, progress=False).fit(progress=False)",
        f"open({str(marker)!r}, 'w').write('ran')",
    )
    c = client(nb, tmp_path, timeout=90)

    def interrupt():
        deadline = time.time() + 80
        while time.time() < deadline and not (run / "metrics.jsonl").is_file():
            time.sleep(0.2)
        time.sleep(0.5)
        os.kill(c.km.provisioner.process.pid, signal.SIGINT)  # what Jupyter's interrupt button sends

    with c.setup_kernel():
        threading.Thread(target=interrupt, daemon=True).start()
        err = None
        try:  # Run All: the cells in order, stopping at the first one that fails (as Jupyter clears its queue)
            for i, cell in enumerate(nb.cells):
                c.execute_cell(cell, i)
        except nbclient.exceptions.CellExecutionError as e:
            err = e
    assert not marker.exists(), "the cell after the interrupted one ran"
    assert "KeyboardInterrupt" in str(err)
    done = [p for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file()]
    assert done, sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not (run / "final").exists()
    assert json.loads((done[-1] / "meta.json").read_text())["step"] > 0


def test_examples_have_no_setup_cell():
    "The example notebooks show figures without a hidden set_matplotlib_formats cell."
    for p in sorted((ROOT / "examples").glob("*.ipynb")):
        assert "set_matplotlib_formats" not in Path(p).read_text(), p


@pytest.mark.parametrize("name", ["01_pretrain", "02_refinement", "03_sft", "04_scaling"])
def test_example_notebook_runs_all_in_a_kernel(name):
    """Each example notebook, Run All in a real kernel with its default switches (the chain's runs are reused when
    `nbdev-test examples` already trained them): no error, every figure a PNG, nothing on stderr but warnings."""
    path = ROOT / "examples" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    client(nb, path.parent, timeout=600).execute()
    figures = [
        c for c in nb.cells if c.cell_type == "code" and any("Figure" in str(o.get("data", {})) for o in c.outputs)
    ]
    assert all("image/png" in mimes(c) for c in figures), [
        c.source[:80] for c in figures if "image/png" not in mimes(c)
    ]
    noise = [s for c in nb.cells if c.cell_type == "code" for s in [stderr(c)] if s and "Warning" not in s]
    assert not [s for s in noise if "Traceback" in s or "Error" in s], noise


def test_notebooks_carry_the_metadata_jupyterlab_writes():
    """JupyterLab marks a notebook modified on opening unless its language_info and its kernel's display name are
    what the kernel reports: nbdev-clean keeps the first (pyproject.toml); tools/nb_metadata.py writes the second into
    examples/, while nbs/ keeps the kernel's name, which nbdev-clean (the sync check) always sets."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager()
    for path in sorted([*(ROOT / "nbs").glob("*.ipynb"), *(ROOT / "examples").glob("*.ipynb")]):
        md = json.loads(path.read_text())["metadata"]
        assert md.get("language_info", {}).get("name") == "python" and md["language_info"].get("version"), path.name
        kernel = md["kernelspec"]
        want = kernel["name"] if path.parent.name == "nbs" else specs.get_kernel_spec(kernel["name"]).display_name
        assert kernel["display_name"] == want, path.name
