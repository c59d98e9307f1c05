"""The attention kernels (sdpa, flex, varlen) against a float64 reference and each other; the kernel choice; the
CUDA masks' size. The CUDA tests are skipped without a GPU."""

import math
import typing
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from cipher_nb.config.load import AttnKernel, model_config
from cipher_nb.model.attention import (
    ATTN_KERNELS,
    AttnMask,
    attend,
    attention_kernel,
    attention_kernels_used,
    attention_mask,
    build_attn_mask,
    varlen_offsets,
    varlen_window_size,
)
from cipher_nb.model.lm import CipherModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU

T = 200  # crosses a 128-position tile, so the block mask has full, partial and empty tiles
DOCS = torch.tensor([[0] * 70 + [1] * 100 + [2] * 30, [0] * 150 + [1] * 50])


def qkv(B=2, H=4, KV=2, T=T, hd=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, hd, generator=g).to(device, dtype) for h in (H, KV, KV)]


def reference(q, k, v, doc_ids=None, window=0, valid=None):
    "float64 from the definition: each query head reads its group's key/value head over the keys its rules allow."
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    B, H, n, hd = q.shape
    g = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for i in range(n):
            keys = [
                j
                for j in range(i + 1)
                if (not window or i - j < window)
                and (doc_ids is None or doc_ids[b, i] == doc_ids[b, j])
                and (valid is None or valid[b, j] or i == j)
            ]
            for h in range(H):
                s = (q[b, h, i] @ k[b, h // g, keys].T / math.sqrt(hd)).softmax(-1)
                out[b, h, i] = s @ v[b, h // g, keys]
    return out


@pytest.mark.parametrize("docs,window", [(DOCS, 0), (None, 40), (DOCS, 40)], ids=["docs", "window", "docs+window"])
def test_flex_matches_dense_sdpa(docs, window):
    q, k, v = qkv()  # GQA: 4 query heads over 2 key/value heads
    dense = attend(q, k, v, build_attn_mask("sdpa", T, docs, window, B=2, device="cpu"))
    flex = attend(q, k, v, build_attn_mask("flex", T, docs, window, B=2, device="cpu"))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense.double(), reference(q, k, v, docs, window), atol=1e-5, rtol=1e-5)


def test_flex_matches_dense_with_validity():
    "The boundary path's segments: padded keys hidden, a padded query sees itself."
    q, k, v = qkv(T=40)
    docs, valid = DOCS[:, ::5], torch.ones(2, 40, dtype=torch.bool)
    valid[0, 33:], valid[1, 20:] = False, False
    dense = attend(q, k, v, build_attn_mask("sdpa", 40, docs, 7, valid=valid))
    flex = attend(q, k, v, build_attn_mask("flex", 40, docs, 7, valid=valid))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense.double(), reference(q, k, v, docs, 7, valid), atol=1e-5, rtol=1e-5)


def test_flex_mask_is_not_t_by_t():
    n = 1024
    docs = (torch.arange(n) // 300).expand(2, n)
    m = build_attn_mask("flex", n, docs, window=256)
    assert isinstance(m.block, BlockMask) and m.dense is None
    tensors = [t for t in m.block.as_tuple() if torch.is_tensor(t)]
    assert max(t.numel() for t in tensors) < n * n // 100
    assert sum(t.numel() * t.element_size() for t in tensors) < 2 * n * n // 100  # dense: 2 * n * n bytes


def small(**kw):
    base = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, n_routed=4, n_shared=1, top_k=2)
    return model_config(**{**base, "expert_d_ff": 32, **kw})


@pytest.mark.parametrize("cfg", [small(vocab=300, tie_embeddings=False), small(boundary=True)], ids=["token", "bp"])
def test_model_flex_equals_sdpa(cfg):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 48))
    docs = torch.tensor([[0] * 12 + [1] * 36, [0] * 30 + [1] * 18])
    ref = CipherModel(cfg).state_dict()
    losses = {}
    for impl in ("sdpa", "flex"):
        m = CipherModel(replace(cfg, attention=replace(cfg.attention, impl=impl, sliding_window=9))).eval()
        m.load_state_dict(ref)
        with torch.no_grad():
            losses[impl] = m(x, labels=x, doc_ids=docs).loss
        assert attention_kernels_used(m) == impl
    torch.testing.assert_close(losses["flex"], losses["sdpa"], atol=1e-5, rtol=1e-5)
    assert abs(losses["sdpa"].item() - math.log(cfg.vocab)) < 1  # a real loss, not a degenerate one


def test_kernel_choice():
    assert ATTN_KERNELS == typing.get_args(AttnKernel) == ("sdpa", "flex", "varlen")
    assert attention_kernel("auto", "cuda", needs_mask=True) == "flex"
    assert attention_kernel("auto", torch.device("cuda", 0), needs_mask=False) == "sdpa"
    assert attention_kernel("auto", "cpu", needs_mask=True, grad=True) == "sdpa"
    assert attention_kernel("auto", "cpu", needs_mask=False) == "sdpa"
    assert build_attn_mask("sdpa", 8).dense is None  # no mask needed: plain is_causal SDPA
    with pytest.raises(ValueError, match="varlen needs CUDA.*use auto or sdpa"):
        attention_kernel("varlen", "cpu", needs_mask=True)
    with pytest.raises(ValueError, match="flex cannot train on cpu.*use auto or sdpa"):
        attention_kernel("flex", "cpu", needs_mask=True, grad=True)


def test_model_records_cpu_kernel():
    m = CipherModel(small(vocab=300, n_routed=0))
    assert attention_kernels_used(m) == ""
    x = torch.randint(0, 256, (1, 16))
    m(x, labels=x)
    assert attention_kernels_used(m) == "sdpa"
    m = CipherModel(replace(m.cfg, attention=replace(m.cfg.attention, impl="flex"))).train()
    with pytest.raises(ValueError, match="use auto or sdpa"):
        m(x, labels=x)


def test_varlen_offsets_by_hand():
    assert (varlen_window_size(0), varlen_window_size(1), varlen_window_size(5)) == ((-1, 0), (0, 0), (4, 0))
    cu, longest = varlen_offsets(torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]))
    assert cu.tolist() == [0, 2, 5, 9, 10] and cu.dtype == torch.int32 and longest == 4
    cu, longest = varlen_offsets(B=3, T=4)
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4
    m = build_attn_mask("varlen", 5, torch.tensor([[3, 3, 3, 7, 7]]), window=2)
    assert (m.kernel, m.cu_seqlens.tolist(), m.max_len, m.window) == ("varlen", [0, 3, 5], 3, 2)


def flash_varlen_reference(q, k, v, cu, window_size):
    "What flash varlen computes, by its documented rule: per sequence, query i sees keys i - left .. i + right."
    left, right = window_size
    out = torch.zeros_like(q)
    g = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        i = torch.arange(e - s)
        ok = (i[None] <= i[:, None] + right) & ((left < 0) | (i[None] >= i[:, None] - left))
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=ok).transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [0, 40])
def test_varlen_arguments_give_the_dense_attention(window):
    "Our offsets and window_size, fed to flash varlen's documented rule, are the dense-masked attention."
    q, k, v = qkv()
    m = build_attn_mask("varlen", T, DOCS, window)
    B, H, n, hd = q.shape
    flat = [t.transpose(1, 2).reshape(B * n, t.shape[1], hd) for t in (q, k, v)]
    y = flash_varlen_reference(*flat, m.cu_seqlens, varlen_window_size(m.window)).view(B, n, H, hd).transpose(1, 2)
    torch.testing.assert_close(y, attend(q, k, v, AttnMask("sdpa", dense=attention_mask(T, DOCS, window))))


@cuda
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
@pytest.mark.parametrize("window", [0, 40])
def test_cuda_kernels_match_dense(kernel, window):
    q, k, v = (t.requires_grad_() for t in qkv(device="cuda", dtype=torch.bfloat16))
    docs = DOCS.cuda()
    y = attend(q, k, v, build_attn_mask(kernel, T, docs, window, device="cuda"))
    ref = reference(q, k, v, docs.cpu(), window).to(y)
    torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)
    y.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
