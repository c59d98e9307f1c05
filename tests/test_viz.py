"cipher-plot as a process: on a real short run it writes valid PNG files with the expected panels."

import json
import shutil

import pytest
from conftest import run_cli, run_in_process, script
from PIL import Image

EXPECTED = {  # file -> its panels, in order (the boundary model's three MoE layers are 0, 1, 2)
    "training.png": ["loss", "learning rate", "gradient norm", "throughput"],
    "routing.png": [
        "expert load, layer 0",
        "expert load, layer 1",
        "expert load, layer 2",
        "routing entropy",
        "cross-population overlap",
    ],
    "loops.png": ["per-loop hidden norm", "per-loop token similarity", "per-loop gradient norm"],
    "boundaries.png": ["learned byte boundaries"],
}


@pytest.fixture
def run(features_run):
    "conftest's short run of a model with every feature the plots show (shared with test_notebook_kernel)."
    return features_run


def plot(*args):
    "cipher-plot ARGS in this process (test_cipher_plot_writes_valid_pngs_with_expected_panels runs it as one)."
    from cipher_nb.viz.plots import cipher_plot

    return run_in_process(cipher_plot, *args)


def test_cipher_plot_writes_valid_pngs_with_expected_panels(run, tmp_path):
    out = tmp_path / "png"
    r = run_cli(script("cipher-plot"), str(run), "--out", str(out), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPECTED)
    for name, panels in EXPECTED.items():
        p = out / name
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(p) as im:
            im.verify()  # chunk CRCs and structure
        with Image.open(p) as im:
            im.load()  # the pixels decode
            assert im.text["Description"].split(" | ") == panels, name
            assert im.width > 300 and im.height > 100
            assert sum(c > 0 for c in im.convert("L").histogram()) > 16, f"{name} is blank"  # grey levels in use
        assert f"{p}: {' | '.join(panels)}" in r.stdout  # the command says what it wrote


def test_panels_follow_the_metrics(run):
    "The heatmap's panels are the MoE layers the run logged, each with one row per expert and one column per log row."
    from cipher_nb.viz.plots import expert_load_matrix, panel_titles, run_figures

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    layers = sorted(
        {
            int(k.split("layer")[1].split("_")[0])
            for r in rows
            for k in r
            if k.startswith("router/layer") and k.endswith("_max_load")
        }
    )
    figs = run_figures(run)
    assert [t for t in panel_titles(figs["routing"]) if t.startswith("expert load")] == [
        f"expert load, layer {i}" for i in layers
    ]
    steps, loads = expert_load_matrix(rows, layers[0])
    assert loads.shape == (4, len([r for r in rows if f"router/layer{layers[0]}_max_load" in r]))
    assert loads.max(0).tolist() == pytest.approx(
        [r[f"router/layer{layers[0]}_max_load"] for r in rows if f"router/layer{layers[0]}_max_load" in r]
    )


def test_cipher_plot_default_folder_and_no_boundary_figure_without_export(run, tmp_path):
    "Without final/ there is no boundary picture; the default output folder is RUN/plots."
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("metrics.jsonl", "config.yaml"):
        shutil.copy(run / f, bare / f)
    r = plot(str(bare))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (bare / "plots").iterdir()) == ["loops.png", "routing.png", "training.png"]


@pytest.mark.parametrize(
    "setup, expect",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "metrics"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')), "line 2"),
    ],
)
def test_cipher_plot_bad_run_dir_fails_clearly(tmp_path, setup, expect):
    d = tmp_path / "nothing"
    setup(d)
    r = plot(str(d))
    assert r.returncode == 2
    assert "cipher-plot" in r.stderr and expect in r.stderr and "Traceback" not in r.stderr
