"""`cipher-export --format hf`: each mapped kind loads with `AutoModelForCausalLM` and matches cipher_nb's logits and
greedy continuation; token-level runs carry their tokenizer; unmappable configs are refused with the field named."""

import json
import shutil

import pytest
import torch
from fastcore.script import CliError

transformers = pytest.importorskip("transformers")

from cipher_nb.config.load import load_config  # noqa: E402
from cipher_nb.data.codecs import ByteCodec, TokenizerCodec, train_bpe  # noqa: E402
from cipher_nb.eval.harness import load_model  # noqa: E402
from cipher_nb.model.lm import CipherModel  # noqa: E402
from cipher_nb.model.moe import update_moe_biases  # noqa: E402
from cipher_nb.persist.export import export_model, load  # noqa: E402
from cipher_nb.persist.hf import UnmappableConfig, check_hf_export, cipher_export, hf_architecture  # noqa: E402

SMALL = [
    "model.d_model=32",
    "model.n_layers=3",
    "model.moe.n_routed=4",
    "model.moe.expert_d_ff=16",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
]
SOFTMAX = [
    "model.moe.router_score=softmax",
    "model.moe.n_shared=0",
    "model.moe.n_dense_layers=0",
    "model.moe.bias_balance=false",
]
TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
) * 8


def train_steps(model, ids, steps=4, lr=3e-3):
    "A few AdamW steps with loss-free balancing, so weights and biases are a trained model's, not an init."
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        (out.loss + sum(out.aux.values())).backward()
        opt.step()
        opt.zero_grad()
        update_moe_biases(model, out.stats)
    return model.eval()


def greedy(model, ids, n=16):
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    return ids


def assert_same_model(model, out, ids):
    "fp32 logits within 1e-4 and the same greedy continuation, through transformers' own loader and generate."
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (hf(ids).logits - model(ids).logits).abs().max().item()
        new = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert gap < 1e-4, gap
    assert torch.equal(new, greedy(model, ids))
    return hf


def test_default_run_exports_to_glm4_moe_with_a_byte_tokenizer(tmp_path):
    cfg = load_config()  # tiny-cpu: byte-level, GQA, sigmoid routing + bias, one shared expert, a dense first layer
    codec = ByteCodec()
    torch.manual_seed(0)
    ids = torch.as_tensor(codec.encode_doc(TEXT[:200]))[None]
    model = train_steps(CipherModel(cfg.model), ids)
    biases = [b for n, b in model.named_buffers() if n.endswith("expert_bias")]
    assert all(b.abs().sum() > 0 for b in biases)  # the balancing bias moved: the export must carry it
    export_model(model, tmp_path / "run" / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    assert cipher_export(str(tmp_path / "run"), str(tmp_path / "hf")) == "Glm4MoeForCausalLM"
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["Glm4MoeForCausalLM"] and conf["rope_parameters"]["partial_rotary_factor"] == 1.0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = "def mul(a, b):  # é"
    enc = tok(prompt, return_tensors="pt").input_ids
    assert enc[0].tolist() == [codec.bos, *codec.encode(prompt).tolist()]
    assert_same_model(model, tmp_path / "hf", enc)


def test_token_level_softmax_moe_exports_to_mixtral_with_its_tokenizer(tmp_path):
    src = train_bpe([TEXT], 300, tmp_path / "tok" / "tokenizer.json")
    cfg = load_config(
        None, [*SMALL, *SOFTMAX, "data.codec=tokenizer", f"data.tokenizer={src.path}", f"model.vocab={src.vocab_size}"]
    )
    torch.manual_seed(1)
    ids = torch.as_tensor(src.encode_doc(TEXT))[None]
    model = train_steps(CipherModel(cfg.model), ids)
    codec_info = dict(kind="tokenizer", tokenizer=str(src.path))
    meta = dict(config=cfg.to_dict(), step=4)  # what the trainer's meta carries
    export_model(model, tmp_path / "run" / "final", config=cfg.to_dict(), codec=codec_info, meta=meta)
    shutil.rmtree(tmp_path / "tok")  # the export carries its own tokenizer.json
    _, codec = load(tmp_path / "run")
    assert isinstance(codec, TokenizerCodec) and codec.specials == src.specials
    _, _, ev_codec = load_model(tmp_path / "run" / "final")  # cipher-eval's loader takes the carried tokenizer too
    assert isinstance(ev_codec, TokenizerCodec) and ev_codec.encode(TEXT).tolist() == src.encode(TEXT).tolist()
    assert cipher_export(str(tmp_path / "run"), str(tmp_path / "hf")) == "MixtralForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = "class Point:\n    def"
    enc = tok(prompt, return_tensors="pt").input_ids
    assert enc[0].tolist() == [codec.bos, *codec.encode(prompt).tolist()]
    assert_same_model(model, tmp_path / "hf", enc)


@pytest.mark.parametrize("q_lora_rank, norm_eps", [(0, 1e-5), (12, 1e-3)])
def test_latent_attention_moe_exports_to_deepseek_v3(tmp_path, q_lora_rank, norm_eps):
    # sigmoid routing + bias, a shared expert, a dense first layer; weights large enough that a RoPE pair out of place
    # shows, and norm_eps away from the 1e-6 transformers gives DeepSeek-V3's latent norms
    mla = ["model.attention.kind=mla", "model.attention.kv_lora_rank=16", "model.attention.rope_head_dim=8"]
    overrides = [*mla, f"model.attention.q_lora_rank={q_lora_rank}", f"model.norm_eps={norm_eps}"]
    cfg = load_config(None, [*SMALL, *overrides, "model.moe.route_scale=2.5", "model.init_std=0.1"])
    codec = ByteCodec()
    torch.manual_seed(5 + q_lora_rank)
    ids = torch.as_tensor(codec.encode_doc(TEXT[:200]))[None]
    model = train_steps(CipherModel(cfg.model), ids)
    assert all(b.abs().sum() > 0 for n, b in model.named_buffers() if n.endswith("expert_bias"))
    export_model(model, tmp_path / "run" / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    assert cipher_export(str(tmp_path / "run"), str(tmp_path / "hf")) == "DeepseekV3ForCausalLM"
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["q_lora_rank"] == (q_lora_rank or None) and conf["rope_interleave"]
    assert (conf["first_k_dense_replace"], conf["n_group"], conf["routed_scaling_factor"]) == (1, 1, 2.5)
    enc = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("def mul(a, b):", return_tensors="pt").input_ids
    assert_same_model(model, tmp_path / "hf", enc)


@pytest.mark.parametrize(
    "overrides, arch",
    [
        (["model.moe.n_routed=0"], "LlamaForCausalLM"),
        (["model.moe.n_routed=0", "model.attention.sliding_window=6"], "MistralForCausalLM"),
    ],
)
def test_dense_models_export_to_llama_or_mistral(tmp_path, overrides, arch):
    cfg = load_config(None, [*SMALL, *overrides, "model.tie_embeddings=false"])
    codec = ByteCodec()
    torch.manual_seed(2)
    ids = torch.as_tensor(codec.encode_doc(TEXT[:120]))[None]
    model = train_steps(CipherModel(cfg.model), ids)
    export_model(model, tmp_path / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    assert cipher_export(str(tmp_path / "final"), str(tmp_path / "hf")) == arch
    assert_same_model(model, tmp_path / "hf", ids[:, :20])


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model.boundary.enabled=true"], "model.boundary.enabled"),
        (
            ["model.recurrence.n_prelude=1", "model.recurrence.n_core=1", "model.recurrence.n_coda=1"],
            "model.recurrence.n_core",
        ),
        (["model.engram.layers=[1]"], "model.engram.layers"),
        (
            ["model.moe.kind=shared_projection", "model.moe.shared_inter=32", "model.moe.expert_rank=8"],
            "model.moe.kind",
        ),
        (
            ["model.attention.kind=mla", "model.moe.router_score=softmax", "model.moe.bias_balance=false"],
            "model.moe.router_score",
        ),
        (["model.attention.kind=mla", "model.attention.sliding_window=16"], "model.attention.sliding_window"),
        (["model.attention.kind=mla", "model.attention.rope_scaling=4"], "model.attention.rope_scaling"),
        (["model.attention.rope_scaling=4"], "model.attention.rope_scaling"),
        (["model.attention.sliding_window=16"], "model.attention.sliding_window"),
        (["model.moe.router_score=softmax", "model.moe.bias_balance=false"], "model.moe.n_shared"),
    ],
)
def test_unmappable_configs_are_refused_with_the_field_named(tmp_path, overrides, field):
    cfg = load_config(None, [*SMALL, *overrides])
    with pytest.raises(UnmappableConfig, match=field.replace(".", r"\.")) as e:
        hf_architecture(cfg.model)
    assert len(str(e.value).splitlines()) == 1
    export_model(CipherModel(cfg.model), tmp_path / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    with pytest.raises(CliError, match=field.replace(".", r"\.")):  # the command refuses it too, writing nothing
        cipher_export(str(tmp_path / "final"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_cipher_export_checks_its_source_and_never_writes_into_it(tmp_path):
    cfg = load_config(None, SMALL)
    export_model(CipherModel(cfg.model), tmp_path / "run" / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    for out in ("run/final", "run/final/hf", "run"):
        with pytest.raises(CliError, match="the export being read|--force"):
            cipher_export(str(tmp_path / "run"), str(tmp_path / out))
    w = tmp_path / "run" / "final" / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    w.write_bytes(raw)
    with pytest.raises(CliError, match=r"model\.safetensors: its SHA-256 does not match the marker's"):
        cipher_export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written


def test_the_check_fails_on_a_checkpoint_that_differs(tmp_path):
    cfg = load_config(None, SMALL)
    torch.manual_seed(3)
    model = CipherModel(cfg.model).eval()
    export_model(model, tmp_path / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    cipher_export(str(tmp_path / "final"), str(tmp_path / "hf"))
    with torch.no_grad():
        model.layers[1].ffn.router.weight[0] += 1.0  # another routing than the one written
    with pytest.raises(RuntimeError, match="differ from cipher_nb's"):
        check_hf_export(model, tmp_path / "hf")


@pytest.mark.parametrize(
    "overrides, arch",
    [
        ([], "Glm4MoeForCausalLM"),
        (["model.attention.kind=mla", "model.attention.q_lora_rank=12"], "DeepseekV3ForCausalLM"),
    ],
)
def test_a_bf16_model_exports_and_is_left_as_it_was(tmp_path, overrides, arch):
    from cipher_nb.persist.hf import export_hf

    cfg = load_config(None, [*SMALL, *overrides])
    torch.manual_seed(4)
    model = CipherModel(cfg.model).to(torch.bfloat16).train()
    assert export_hf(model, ByteCodec(), tmp_path / "hf") == arch  # checked in fp32 against a copy
    assert next(model.parameters()).dtype == torch.bfloat16 and model.training


def test_an_sft_export_carries_a_chat_template_that_renders_the_trained_ids(tmp_path):
    from cipher_nb.train.sft import render_conversation

    cfg = load_config(None, [*SMALL, "stage.name=sft"])
    model, codec = CipherModel(cfg.model).eval(), ByteCodec()
    export_model(model, tmp_path / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    assert (tmp_path / "final" / "chat_template.jinja").is_file()
    cipher_export(str(tmp_path / "final"), str(tmp_path / "hf"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    msgs = [dict(role="system", content="Be brief."), dict(role="user", content="2 + 2?")]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == render_conversation(msgs, codec, generation_prompt=True)[0].tolist()
