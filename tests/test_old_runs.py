"Runs saved before the second reshaping still load: exports with the same loss, checkpoints resume exactly."

import json
import shutil

import pytest
import torch
from conftest import ROOT, run_cli

OLD = ROOT / "tests" / "fixtures" / "runs-7ac1b85"
REF = json.loads((OLD / "reference.json").read_text())
TEXT = b"def fixture(x):\n    return x * 2  # the same bytes before and after the reshaping\n"


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("name", sorted(REF))
def test_an_old_export_loads_with_the_same_names_and_loss(name):
    from cipher_nb.model.lm import renamed
    from cipher_nb.persist.export import load

    model, _ = load(OLD / name / "final")
    sd = model.state_dict()
    assert sorted(sd) == sorted(map(renamed, REF[name]["names"]))  # the key map, every old name
    with torch.no_grad():
        loss = model(torch.tensor([list(TEXT[:64])]), labels=torch.tensor([list(TEXT[1:65])])).loss.item()
    assert loss == pytest.approx(REF[name]["export_loss"], abs=1e-6)


@pytest.mark.parametrize("name", sorted(REF))
def test_an_old_checkpoint_resumes_exactly(tmp_path, name):
    run = tmp_path / name
    shutil.copytree(OLD / name, run)
    r = run_cli("cipher-train", "--out", str(run), "--resume", "auto", "--quiet", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert losses(run)[4] == REF[name]["step4_loss"]


def test_old_weights_start_a_run_through_init(tmp_path):
    old = OLD / "flexi"
    args = ["--init", str(old / "checkpoints" / "step_0000003"), "--max-steps", "1", str(old / "config.yaml")]
    r = run_cli("cipher-train", "--out", str(tmp_path / "run"), "--quiet", *args, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert losses(tmp_path / "run")[1] == pytest.approx(REF["flexi"]["init_step1_loss"], abs=1e-6)


def test_old_names_load_through_the_distributed_api():
    "DCP's `set_model_state_dict` (an FSDP2 run's `--init`) matches names before the model's load hook: renamed first."
    from safetensors.torch import load_file

    from cipher_nb.config.load import config_from_dict
    from cipher_nb.model.lm import CipherModel
    from cipher_nb.persist.checkpointer import _set_model

    final = OLD / "flexi" / "final"
    old = load_file(final / "model.safetensors")
    model = CipherModel(config_from_dict(json.loads((final / "config.json").read_text())["config"]).model)
    _set_model(model, old, final, strict=False, dcp_api=True)
    assert torch.equal(model.state_dict()["hourglass.boundary.mlp.0.weight"], old["boundary.mlp.0.weight"])
