"Every shipped preset loads, and the model it describes has the parameter count `cipher-config` prints for it."

from pathlib import Path

import pytest
import torch
from conftest import ROOT

from cipher_nb.config import load_config
from cipher_nb.model import CipherModel
from cipher_nb.sizing import param_counts

PRESETS = sorted((ROOT / "examples/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: Path(p).stem)
def test_preset_builds_on_meta_with_its_counted_parameters(path):
    "Built on the meta device (no memory, so the 2B-parameter H100 presets build on a CPU runner too)."
    cfg = load_config(path)
    with torch.device("meta"):
        model = CipherModel(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg.model)["total"], path.name


def test_flexitokens_h100_has_the_training_scripts_shapes():
    m = load_config(ROOT / "examples/configs/flexitokens-h100.yaml").model
    r, e = m.recurrence, m.moe
    assert (m.vocab, m.d_model, r.n_prelude, r.n_core, r.n_coda, r.n_loops) == (272, 2048, 2, 6, 2, 6)
    assert (e.kind, e.n_routed, e.top_k, e.shared_inter, e.expert_rank) == ("shared_projection", 32, 2, 6144, 256)
    assert r.halting and r.injection == "lti" and r.loop_lora_rank > 0 and m.boundary.enabled
    assert [i - r.n_prelude for i in m.engram.layers] == [1, 4]  # the core's layers 1 and 4
