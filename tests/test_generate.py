"""Generation through the KV cache against the full forward (float64 on CPU, logits to 1e-9: the cached and full
paths sum in different orders), in every mode the cache serves: GQA dense and MoE, a sliding window the sequence
outruns, a recurrent core with a fixed loop count and with ACT halting (including the recompute on `CacheMiss`),
Engram memory (the cache keeps each row's last ids), and the exact fallback of boundary-predictor models; batched
generation against one prompt at a time; determinism."""

import pytest
import torch

from cipher_nb.config.load import model_config
from cipher_nb.data.codecs import ByteCodec
from cipher_nb.eval.harness import can_cache, generate, generate_batch, prompt_ids, sample_batch, sample_ids
from cipher_nb.model.attention import CacheMiss
from cipher_nb.model.lm import CipherModel

TOL = 1e-9
BASE = dict(
    d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, n_routed=4, n_shared=1, top_k=2, expert_d_ff=16
)
ACT = dict(n_layers=4, recurrence=dict(n_prelude=1, n_core=2, n_coda=1, n_loops=6, halting=True, halt_threshold=0.99))
MODES = {
    "dense": dict(n_routed=0),
    "moe": {},
    "window": dict(sliding_window=5),
    "recurrent": dict(n_layers=4, n_prelude=1, n_core=2, n_coda=1, n_loops=3),
    "recurrent lti lora window": dict(
        n_layers=4,
        sliding_window=6,
        recurrence=dict(n_prelude=1, n_core=2, n_coda=1, n_loops=3, injection="lti", loop_lora_rank=2),
    ),
    "act": ACT,
    "engram": dict(engram=dict(layers=[0, 2], table_size=61, dim=16, max_ngram=4)),
    "recurrent engram": dict(
        n_layers=4, n_prelude=1, n_core=2, n_coda=1, n_loops=3, engram=dict(layers=[1], table_size=61, dim=16)
    ),
}


def build(seed=0, **kw) -> CipherModel:
    torch.manual_seed(seed)
    m = CipherModel(model_config(**{**BASE, **kw})).double().eval()
    if m.cfg.recurrence.halting:  # spread the halting loops, so that tokens need different loop counts
        torch.nn.init.normal_(m.recurrence.halt.weight, std=3.0)
        m.recurrence.halt.bias.data.fill_(-1.0)
    return m


def stepwise_logits(m, x, prompt: int) -> tuple:
    "Last-position logits after each prefix [B, T - prompt + 1, V] through the cache, and the recomputes taken."
    c = m.new_cache(x.shape[0], x.shape[1])
    out, misses = [m.step(x[:, :prompt], c)[:, -1]], 0
    for t in range(prompt, x.shape[1]):
        try:
            out.append(m.step(x[:, t : t + 1], c)[:, -1])
        except CacheMiss:  # what the generator does: the whole context into a fresh cache
            misses += 1
            c = m.new_cache(x.shape[0], x.shape[1])
            out.append(m.step(x[:, : t + 1], c)[:, -1])
    return torch.stack(out, 1), misses


def full_logits(m, x, prompt: int) -> torch.Tensor:
    "The reference: one full forward per prefix, its last position."
    return torch.stack([m(x[:, :t]).logits[:, -1] for t in range(prompt, x.shape[1] + 1)], 1)


@pytest.mark.parametrize("mode", sorted(MODES))
@torch.no_grad()
def test_cached_decode_equals_the_full_forward_at_every_step(mode):
    m = build(**MODES[mode])
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 18))
    got, misses = stepwise_logits(m, x, 6)
    torch.testing.assert_close(got, full_logits(m, x, 6), rtol=0, atol=TOL)


@torch.no_grad()
def test_act_decode_recomputes_when_an_id_needs_a_loop_the_cache_lacks():
    m = build(**MODES["act"])
    torch.manual_seed(0)
    x = torch.randint(0, 256, (1, 18))  # one row and a one-id prompt: the cached depth starts shallow
    got, misses = stepwise_logits(m, x, 1)
    torch.testing.assert_close(got, full_logits(m, x, 1), rtol=0, atol=TOL)
    assert misses >= 1, "no id needed a loop past the cached depth: the recompute went untested"


@torch.no_grad()
def test_the_prompt_logits_equal_the_full_forward_at_every_position():
    m = build(**MODES["window"])
    x = torch.randint(0, 256, (1, 14))
    c = m.new_cache(1, 20)
    torch.testing.assert_close(m(x, cache=c).logits, m(x).logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("mode", ["moe", "window", "recurrent", "engram"])
@torch.no_grad()
def test_a_left_padded_row_decodes_as_it_would_alone(mode):
    m = build(**MODES[mode])
    a, b = torch.randint(0, 256, (1, 15)), torch.randint(0, 256, (1, 11))
    x = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])  # row 1 left-padded by 4
    c = m.new_cache(2, 15, pad=torch.tensor([0, 4]))
    got = [m.step(x[:, :8], c)[:, -1]] + [m.step(x[:, t : t + 1], c)[:, -1] for t in range(8, 15)]
    got = torch.stack(got, 1)
    torch.testing.assert_close(got[:1], full_logits(m, a, 8), rtol=0, atol=TOL)
    torch.testing.assert_close(got[1:], full_logits(m, b, 4), rtol=0, atol=TOL)


@pytest.mark.parametrize("mode", ["moe", "window", "act", "engram"])
def test_batched_generation_equals_one_prompt_at_a_time(mode):
    m, codec = build(**MODES[mode]), ByteCodec()
    prompts = ["def f(x):", "import os\nimport sys", "#"]
    ids = [prompt_ids(p, codec) for p in prompts]
    for kw in (dict(temperature=0), dict(temperature=1.0, top_k=20, top_p=0.9)):
        batch = sample_batch(m, ids, max_new=20, seed=[3, 4, 5], **kw)
        assert batch == [sample_ids(m, i, max_new=20, seed=s, **kw) for i, s in zip(ids, (3, 4, 5))]
        assert batch == sample_batch(m, ids, max_new=20, seed=[3, 4, 5], cache=False, **kw)  # the uncached reference
    assert generate_batch(m, codec, prompts, max_new=12, seed=7) == [
        generate(m, codec, p, max_new=12, seed=7 + b) for b, p in enumerate(prompts)
    ]


def test_greedy_generation_is_deterministic():
    m, codec = build(**MODES["moe"]), ByteCodec()
    runs = {generate(m, codec, "def main():", max_new=40, temperature=0, stop=()) for _ in range(3)}
    assert len(runs) == 1 and len(next(iter(runs))) > 0


@torch.no_grad()
def test_an_engram_prompt_shorter_than_its_ngrams_decodes_exactly():
    "A one-id prompt: the first decode steps read n-grams that reach back before the sequence."
    m = build(**MODES["engram"])
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 9))
    got, _ = stepwise_logits(m, x, 1)
    torch.testing.assert_close(got, full_logits(m, x, 1), rtol=0, atol=TOL)


def test_models_the_cache_cannot_serve_fall_back_to_the_exact_recompute():
    m, codec = build(boundary=dict(enabled=True, mode="causal_fixed")), ByteCodec()
    assert not can_cache(m) and can_cache(build())
    with pytest.raises(ValueError, match="cannot generate through a KV cache"):
        m.new_cache(1, 8)
    assert generate(m, codec, "def ", max_new=10, seed=1) == generate(m, codec, "def ", max_new=10, seed=1, cache=False)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@torch.no_grad()
def test_latent_attention_equals_transformers_deepseek_v3(q_lora_rank):
    from transformers.models.deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from cipher_nb.model.attention import LatentAttention, rope_frequencies, rope_tables

    cfg = model_config(
        d_model=48,
        attention=dict(kind="mla", n_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=q_lora_rank, rope_head_dim=6),
    )
    a = cfg.attention
    torch.manual_seed(0)
    ours = LatentAttention(cfg).double()
    for p in ours.parameters():  # norms away from 1 too, so that a misplaced norm weight shows
        torch.nn.init.normal_(p, std=0.3)
    hf_cfg = DeepseekV3Config(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank or None,
        kv_lora_rank=16,
        qk_rope_head_dim=6,
        qk_nope_head_dim=8,
        v_head_dim=8,
        rope_interleave=False,
        attention_bias=False,
        rms_norm_eps=cfg.norm_eps,
    )
    hf_cfg._attn_implementation = "sdpa"  # eager takes its softmax in float32
    theirs = DeepseekV3Attention(hf_cfg, layer_idx=0).double()
    names = dict(
        q_proj="wq", q_a_proj="wq_a", q_a_layernorm="q_norm", q_b_proj="wq_b", kv_a_proj_with_mqa="wkv_a"
    ) | dict(kv_a_layernorm="kv_norm", kv_b_proj="wkv_b", o_proj="wo")
    for theirs_name, ours_name in names.items():
        if getattr(theirs, theirs_name, None) is not None:
            getattr(theirs, theirs_name).weight.copy_(getattr(ours, ours_name).weight)
    for norm in ("q_a_layernorm", "kv_a_layernorm"):  # theirs normalises in float32 whatever the input: the same
        if getattr(theirs, norm, None) is not None:  # RMSNorm in float64, so that 1e-12 can hold
            w = getattr(theirs, norm).weight
            setattr(theirs, norm, torch.nn.RMSNorm(w.shape[0], eps=cfg.norm_eps).double())
            getattr(theirs, norm).weight.copy_(w)
    B, T = 2, 11
    x = torch.randn(B, T, 48, dtype=torch.float64)
    inv, _ = rope_frequencies(a.rope_head_dim)
    cos, sin = (t.double() for t in rope_tables(torch.arange(T)[None], inv))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    ref, _ = theirs(x, (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), additive)
    torch.testing.assert_close(ours(x, cos, sin), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("absorb", [True, False])
@torch.no_grad()
def test_mla_models_decode_exactly_through_the_cache(absorb):
    m = build(attention=dict(kind="mla", kv_lora_rank=12, q_lora_rank=8, rope_head_dim=4, sliding_window=5))
    for layer in m.modules():
        if hasattr(layer, "absorb"):
            layer.absorb = absorb
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    got, _ = stepwise_logits(m, x, 4)
    torch.testing.assert_close(got, full_logits(m, x, 4), rtol=0, atol=TOL)
