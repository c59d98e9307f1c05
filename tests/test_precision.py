"Precision conversion on real cipher_nb modules, 8-bit AdamW checkpoints through files, and the cross-optimizer resume."

import warnings

import pytest
import torch
import torch.nn as nn

from cipher_nb.config.load import Config, model_config
from cipher_nb.model.moe import MoE
from cipher_nb.optim.optimizers import (
    OptimizerResetWarning,
    build_optimizer,
    load_optimizer_state,
    optimizer_kind,
    optimizer_state,
)
from cipher_nb.optim.precision import DeviceCaps, convert_model, detect_precision, probe_device, probe_libs

torch.set_num_threads(1)  # tiny matmuls: one thread avoids OpenMP spin-waits on a shared box


class Block(nn.Module):
    "A block with the model's parameter names around the real MoE."

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.d_model), nn.RMSNorm(cfg.d_model)
        self.attn = nn.Module()
        self.attn.wq, self.attn.wo = (
            nn.Linear(cfg.d_model, cfg.d_model, bias=False),
            nn.Linear(cfg.d_model, cfg.d_model, bias=False),
        )
        self.ffn = MoE(cfg)

    def forward(self, x):
        x = x + self.attn.wo(torch.tanh(self.attn.wq(self.attn_norm(x))))
        y, aux, _ = self.ffn(self.ffn_norm(x))
        return x + y, sum(aux.values())


class Tiny(nn.Module):
    "embed -> boundary gate -> MoE blocks -> norm -> untied head, named like CipherModel."

    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.boundary = nn.Linear(cfg.d_model, 1)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(2)])
        self.norm, self.head = nn.RMSNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x * torch.sigmoid(self.boundary(x))
        aux = 0
        for blk in self.layers:
            x, a = blk(x)
            aux = aux + a
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) + aux


def tiny_cfg(**kw):
    return model_config(
        vocab=272,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_routed=4,
        top_k=2,
        n_shared=1,
        expert_d_ff=32,
        **kw,
    )


def batch(seed=0, B=2, T=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 272, (B, T), generator=g)
    return dict(input_ids=ids, labels=ids.roll(-1, 1))


def step(model):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch())
    loss.backward()


@pytest.mark.parametrize("mode", ["fp8", "mxfp8"])
def test_convert_real_moe_trains_and_keeps_filtered_modules_high(mode):
    torch.manual_seed(0)
    model = Tiny(tiny_cfg(moe_impl="grouped"))
    report = convert_model(model, detect_precision(mode, DeviceCaps(), emulate=True), probe=step, min_dim=0)
    converted = sorted(report["converted"])
    assert converted == [
        f"layers.{i}.{n}"
        for i in range(2)
        for n in ("attn.wo", "attn.wq", "ffn.shared.w_down", "ffn.shared.w_gate", "ffn.shared.w_up")
    ]
    for name in ("boundary", "head", "layers.0.ffn.router"):
        assert name in report["kept"]
    assert (
        type(model.head) is nn.Linear
        and type(model.layers[0].ffn.router) is nn.Linear
        and type(model.embed) is nn.Embedding
    )
    assert all(
        type(p.data) is torch.Tensor
        for n, p in model.named_parameters()
        if "norm" in n or "boundary" in n or "router" in n
    )
    if mode == "mxfp8":  # torchao emulates MXFP8 grouped GEMMs, so the real MoE's experts go low precision too
        assert sorted(report["experts"]["converted"]) == [
            f"layers.{i}.ffn.experts.{w}" for i in range(2) for w in ("w_down", "w_gate", "w_up")
        ]
    else:  # its fp8 grouped GEMM has no emulation: experts stay high, and the report says why
        assert report["experts"]["converted"] == [] and "no emulated path" in report["experts"]["reason"]
    assert report["kernels"]["calls"][f"mm:{mode}"] > 0 and 0 < report["kernels"]["lowp_share"] < 1
    step(model)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("mode", ["fp8", "mxfp8"])
def test_cipher_model_converts(mode):
    "A byte-level CipherModel with boundary predictor and recurrent core: filter, experts, forward and backward."
    from cipher_nb.model.lm import CipherModel

    torch.manual_seed(0)
    cfg = tiny_cfg(
        n_layers=3, n_prelude=1, n_core=1, n_coda=1, n_loops=2, boundary=True, tie_embeddings=False, moe_impl="grouped"
    )
    model = CipherModel(cfg)
    ids = batch()["input_ids"]

    def probe(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids)
        (out.loss + sum(out.aux.values())).backward()

    report = convert_model(model, detect_precision(mode, DeviceCaps(), emulate=True), probe=probe, min_dim=0)
    kept = report["kept"]
    assert kept["head"] == "LM head" and kept["layers.1.ffn.router"] == "router gate"
    assert {v for k, v in kept.items() if k.startswith("hourglass.boundary.")} == {"boundary predictor"}
    converted = set(report["converted"])
    assert (
        "recurrence.inject" in converted
        and "hourglass.byte_in.0.attn.wq" in converted
        and "layers.1.ffn.shared.w_up" in converted
    )
    assert not any("norm" in n or "boundary" in n or "router" in n or n in ("head", "embed") for n in converted)
    assert all(
        type(p.data) is torch.Tensor
        for n, p in model.named_parameters()
        if any(s in n for s in ("norm", "boundary", "router", "embed", "head"))
    )
    if mode == "mxfp8":
        assert len(report["experts"]["converted"]) == 6, report["experts"]
    else:
        assert report["experts"]["converted"] == []
    assert report["kernels"]["calls"][f"mm:{mode}"] > 0
    probe(model)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "device,want",
    [
        (DeviceCaps(True, (9, 0), True, "H100"), "bf16"),
        (DeviceCaps(True, (10, 0), True, "B200"), "bf16"),
        (DeviceCaps(True, (7, 0), False, "V100"), "fp16"),
        (DeviceCaps(), "fp32"),
    ],
)
def test_auto_is_bf16_on_gpus_and_never_low_precision(device, want):
    libs = probe_libs()
    libs.float8 = libs.fp8_grouped = libs.mxfp8 = libs.nvfp4 = libs.triton = True  # everything on offer
    choice = detect_precision("auto", device, libs)
    assert choice.mode == want and choice.scaler == (want == "fp16"), choice
    assert detect_precision("fp8", DeviceCaps(True, (9, 0), True, "H100"), libs).mode == "fp8"  # asked by name


def test_fp8_min_dim_filters_real_model_layers():
    "A CipherModel of width 64: at min_dim 64 the square projections convert, the narrow ones stay with a reason."
    from cipher_nb.model.lm import CipherModel

    torch.manual_seed(0)
    model = CipherModel(tiny_cfg(n_layers=2, moe_impl="grouped"))
    report = convert_model(model, detect_precision("fp8", DeviceCaps(), emulate=True), min_dim=64)
    # by hand: wq and wo are 64 -> 64 (4 heads of 16); wk, wv 64 -> 32 (2 KV heads); the dense first layer's
    # SwiGLU is 64 -> (2 + 1) x 32 = 96 and back; the shared expert 64 -> 32 and back
    assert sorted(report["converted"]) == sorted(
        [f"layers.{i}.attn.{w}" for i in range(2) for w in ("wq", "wo")]
        + [f"layers.0.ffn.{w}" for w in ("w_gate", "w_up", "w_down")]
    )
    assert report["kept"]["layers.1.attn.wk"] == "out 32 < fp8_min_dim 64"
    assert report["kept"]["layers.1.ffn.shared.w_down"] == "in 32 < fp8_min_dim 64"
    assert report["summary"]["skipped"]["out 32 < fp8_min_dim 64"] == [
        "layers.*.attn.wk",
        "layers.*.attn.wv",
        "layers.*.ffn.shared.w_gate",
        "layers.*.ffn.shared.w_up",
    ]
    assert type(model.layers[1].attn.wk) is nn.Linear and type(model.layers[1].attn.wq).__name__ == "Float8Linear"


def run_steps(model, opt, n, start=0):
    losses = []
    for i in range(start, start + n):
        loss = model(**batch(i % 2))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fresh(name, lr=3e-3):
    torch.manual_seed(0)
    model = Tiny(tiny_cfg(moe_impl="bmm"))
    cfg = Config()
    cfg.optim.name = name
    cfg.schedule.lr = lr
    return model, build_optimizer(model, cfg.optim, cfg.schedule.lr)


def test_adamw8bit_lowers_loss_and_resumes_through_a_file(tmp_path):
    model, opt = fresh("adamw8bit")
    assert optimizer_kind(opt) == "adamw8bit"
    straight = run_steps(model, opt, 8)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert straight[-1] < straight[0] - 0.3, straight

    model, opt = fresh("adamw8bit")
    first = run_steps(model, opt, 4)
    path = tmp_path / "ck.pt"
    torch.save(dict(model=model.state_dict(), optim=optimizer_state(opt)), path)
    ck = torch.load(path, weights_only=True)
    assert ck["optim"]["kind"] == "adamw8bit"
    model, opt = fresh("adamw8bit")
    model.load_state_dict(ck["model"])
    assert load_optimizer_state(opt, ck["optim"], where=str(path)) is True
    second = run_steps(model, opt, 4, start=4)
    assert first + second == straight
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("saved_kind,new_kind", [("adamw8bit", "adamw"), ("adamw", "adamw8bit")])
def test_cross_optimizer_resume_reinitialises_with_a_warning(tmp_path, saved_kind, new_kind):
    model, opt = fresh(saved_kind)
    run_steps(model, opt, 2)
    path = tmp_path / "ck.pt"
    torch.save(dict(model=model.state_dict(), optim=optimizer_state(opt)), path)
    ck = torch.load(path, weights_only=True)
    model, opt = fresh(new_kind)
    model.load_state_dict(ck["model"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert load_optimizer_state(opt, ck["optim"], where=str(path)) is False
    msgs = [str(x.message) for x in w if issubclass(x.category, OptimizerResetWarning)]
    assert len(msgs) == 1 and saved_kind in msgs[0] and new_kind in msgs[0] and str(path) in msgs[0]
    assert len(opt.state) == 0
    losses = run_steps(model, opt, 2, start=2)  # the fresh optimizer trains on from the loaded weights
    assert all(torch.isfinite(torch.tensor(losses)))


def test_bare_state_dict_kind_is_inferred():
    model, opt = fresh("adamw")
    run_steps(model, opt, 1)
    sd = opt.state_dict()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert load_optimizer_state(fresh("adamw8bit")[1], sd) is False
    assert any(issubclass(x.category, OptimizerResetWarning) for x in w)
    assert load_optimizer_state(fresh("adamw")[1], sd) is True


def test_detection_on_this_machine_matches_the_device():
    caps = probe_device()
    choice = detect_precision("auto")
    if not caps.cuda:
        assert choice.mode == "fp32" and "CPU" in choice.reason
    else:
        assert choice.mode in ("bf16", "fp16")  # auto never picks a low-precision mode
    libs = probe_libs()
    assert libs.float8, libs.why  # torchao is a dependency: its float8 path must import


def test_failed_conversion_falls_back_to_bf16_and_the_record_says_so(tmp_path, monkeypatch, capsys):
    "A run asked for fp8 whose conversion raises trains in bf16: one stderr line; the record and card say why."
    from dataclasses import asdict

    from conftest import TINY

    import cipher_nb.optim.precision as prec
    import cipher_nb.train.builder as builder
    from cipher_nb.config.load import load_config
    from cipher_nb.persist.export import model_card

    def broken(*a, **k):
        raise RuntimeError("injected: no fp8 kernel for this layer")

    asked = detect_precision("fp8", DeviceCaps(), emulate=True)  # what a GPU would choose, emulated on this CPU
    monkeypatch.setattr(builder, "detect_precision", lambda *a, **k: asked)
    monkeypatch.setattr(prec, "_convert_dense", broken)
    corpus = tmp_path / "corpus"  # a few small files: fingerprinting the whole stdlib would cost seconds
    corpus.mkdir()
    for i in range(8):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    over = ["training.precision=fp8", "training.fp8_min_dim=0", "data.source=files", f"data.path={corpus}"]
    cfg = load_config(None, [*TINY, *over, "data.heldout_frac=0.25", "training.eval_batches=1"])
    tr = builder.build_trainer(cfg, tmp_path / "run", progress=False)
    p = tr.record.precision
    assert (p["requested"], p["mode"], tr.dtype) == ("fp8", "bf16", torch.bfloat16)
    assert "injected: no fp8 kernel" in p["fallback"] and "fell back to bf16" in p["reason"]
    assert tr.record.data["heldout_targets"] > 0  # the held-out size the card names
    err = [line for line in capsys.readouterr().err.splitlines() if "training in bf16 instead" in line]
    assert len(err) == 1 and "fp8 conversion failed" in err[0]
    assert all(
        type(m) is nn.Linear for m in tr.raw_model.modules() if isinstance(m, nn.Linear)
    )  # nothing half-converted
    card = model_card(cfg.to_dict(), {}, asdict(tr.record)).split("## Limitations")[1]
    assert "asked for fp8, trained in bf16 (fp8 conversion failed (RuntimeError: injected" in card
