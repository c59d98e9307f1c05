"""A minimal dense GPT, written from scratch: the outside baseline of benchmarks/quality.py.

The recipe a practitioner uses for a small model on a CPU: bytes as tokens (vocabulary 256), 4 pre-norm blocks of
width 128 with 4 heads, context 64, causal attention through `scaled_dot_product_attention`, learned positions, tied
input/output embeddings, AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1 on matrices only, gradient clipping at 1)
with a short linear warmup and a cosine decay to lr/10 at the last step, batches of 12 x 64 bytes. Nothing here comes
from cipher_nb's model, trainer or optimizer code.

Data: the training bytes come from cipher_nb's own loader for the base config (`build_loader`'s train split), so the
documents, their order for a seed and the held-out split are exactly the ones the cipher_nb contenders see; only the
model and the recipe differ. Each loader row (seq_len ids) is cut into pieces of 64 and the pieces are regrouped 12 at
a time. The loader's specials become the minimal GPT's own vocabulary this way: an input special (the BOS that opens
each document) is read as byte 0, a document separator; a special target (the EOS that closes a document, padding)
is never trained on nor scored.

Scoring: `HeldoutView` wraps the model in the interface `cipher_nb.monitor.metrics.heldout_metrics` calls
(`model(input_ids=,
labels=, doc_ids=)` returning `.loss`, the mean nats over the labels that are not -100), so the minimal GPT's held-out
bits per byte come from that same function on the same batches: nats summed over every target byte / bytes / ln 2.
Rows longer than the context are scored with a sliding window: every target exactly once, each with at least half a
context (32 bytes) of history except the first ones of a row.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, N_LAYERS, WIDTH, N_HEADS, CONTEXT, BATCH = 256, 4, 128, 4, 64, 12
LR, MIN_LR, WARMUP, BETAS, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 1e-4, 100, (0.9, 0.99), 0.1, 1.0


class Block(nn.Module):
    "Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, head_dim]
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class MinimalGPT(nn.Module):
    "Byte-level GPT: token + position embeddings, pre-norm blocks, final norm, head tied to the token embedding."

    def __init__(self, vocab=VOCAB, n_layers=N_LAYERS, d=WIDTH, n_heads=N_HEADS, context=CONTEXT):
        super().__init__()
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d)
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("proj.weight") or n.endswith("mlp.2.weight"):  # residual outputs scaled by depth (GPT-2)
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):
        "Logits [B, T, vocab] for byte ids `idx` [B, T], T <= context."
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.T


def to_bytes(input_ids, labels):
    "A loader batch in the minimal GPT's vocabulary: special inputs read as byte 0, special targets ignored (-100)."
    return input_ids.masked_fill(input_ids >= VOCAB, 0), labels.masked_fill(labels >= VOCAB, -100)


def byte_batches(loader, batch: int = BATCH, context: int = CONTEXT):
    "Batches of `batch` x `context` (inputs, targets) cut from a cipher_nb loader's rows, in the loader's order."
    xs, ys = [], []
    for b in loader:
        x, y = to_bytes(b["input_ids"], b["labels"])
        T = x.shape[1] // context * context
        xs += list(x[:, :T].reshape(-1, context))
        ys += list(y[:, :T].reshape(-1, context))
        while len(xs) >= batch:
            yield torch.stack(xs[:batch]), torch.stack(ys[:batch])
            xs, ys = xs[batch:], ys[batch:]


def windows(T: int, context: int):
    "(start, first scored position) of the sliding windows that score each of T targets once, stride context/2."
    if T <= context:
        return [(0, 0)]
    starts = list(range(0, T - context + 1, context // 2))
    if starts[-1] != T - context:
        starts.append(T - context)
    return [(s, 0 if i == 0 else starts[i - 1] + context) for i, s in enumerate(starts)]


class HeldoutView(nn.Module):
    "The minimal GPT seen through the call `heldout_metrics` makes: `.loss` = mean nats over labels != -100."

    def __init__(self, gpt: MinimalGPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels, **_):  # doc_ids unused: the minimal GPT attends across documents
        x, y = to_bytes(input_ids, labels)
        nats, n = torch.zeros((), dtype=torch.float64, device=x.device), (y != -100).sum()
        for s, first in windows(x.shape[1], self.gpt.context):
            logits = self.gpt(x[:, s : s + self.gpt.context]).float()
            t = y[:, s : s + self.gpt.context].clone()
            t[:, : first - s] = -100  # already scored by an earlier window
            nats += F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum").double()
        return SimpleNamespace(loss=nats / n.clamp(min=1))


def lr_at(step: int, steps: int, warmup: int, lr: float = LR, min_lr: float = MIN_LR) -> float:
    "Linear warmup over `warmup` steps, then a cosine from `lr` to `min_lr` reached at the last step (steps - 1)."
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - 1 - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


class MinimalTrainer:
    "The minimal GPT's training loop, one `train_step()` at a time (the interface benchmarks/quality.py drives)."

    def __init__(self, loader, steps: int, seed: int = 0, batch: int = BATCH, context: int = CONTEXT):
        torch.manual_seed(seed)
        self.model, self.device, self.dtype = MinimalGPT(context=context), torch.device("cpu"), torch.float32
        self.steps, self.warmup = steps, min(WARMUP, max(1, steps // 10))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [dict(params=decay, weight_decay=WEIGHT_DECAY), dict(params=rest, weight_decay=0.0)]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
        self.data, self.step, self.tokens = byte_batches(loader, batch, context), 0, 0

    def train_step(self) -> float:
        "One optimizer step on the next batch; returns its training loss (nats per target byte)."
        x, y = next(self.data)
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.steps, self.warmup)
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.step, self.tokens = self.step + 1, self.tokens + x.numel()
        return loss.item()


def n_params(model: nn.Module) -> int:
    "Parameters, the tied embedding counted once."
    return sum(p.numel() for p in model.parameters())
