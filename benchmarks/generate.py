"""Generation speed: ids per second through the KV cache against recomputing the whole context for every new id
(no crop), side by side in one process, on untrained models (speed does not depend on the weights).

    OMP_NUM_THREADS=1 python benchmarks/generate.py            # 1,000 new ids after a 256-id prompt
    OMP_NUM_THREADS=1 python benchmarks/generate.py --new 200  # a quicker look

Configs: `tiny-cpu` (the config defaults, the `cipher-train` default), a recurrent byte model (tiny-cpu with a
prelude, a core looped 3 times and a coda) and tiny-cpu with latent attention (MLA). Prints one line per config,
`tiny-cpu: cached/uncached 12.3x`, with the ids/s of each and how many of the sampled ids agree (float32: the two
paths round differently, so a long sample may part ways once a draw falls on a boundary); for MLA also its two
decode forms, `absorb/expand` (the latent's up-projection folded into the query and output, or applied to every
cached latent each step)."""

import argparse
import time

import numpy as np
import torch
from bench_args import at_least

from cipher_nb.config.load import model_config
from cipher_nb.eval.harness import sample_ids
from cipher_nb.model.lm import CipherModel

CONFIGS = {
    "tiny-cpu": {},
    "tiny-cpu recurrent (1 + 2x3 + 1)": dict(n_layers=4, n_prelude=1, n_core=2, n_coda=1, n_loops=3),
    "tiny-cpu mla": dict(attention=dict(kind="mla", n_heads=2, head_dim=64, kv_lora_rank=64, rope_head_dim=16)),
}


def ids_per_second(model, prompt, new: int, cache: bool) -> tuple:
    "(ids/s, the ids) of one seeded sample of `new` ids after `prompt` (no stop id)."
    t0 = time.perf_counter()
    out = sample_ids(model, prompt, max_new=new, temperature=1.0, stop=(), seed=0, cache=cache)
    return len(out) / (time.perf_counter() - t0), out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=at_least(1), default=1000, help="new ids to sample")
    p.add_argument("--prompt", type=at_least(1), default=256, help="prompt length in ids")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.new} new ids after {args.prompt}")
    for name, kw in CONFIGS.items():
        torch.manual_seed(0)
        model = CipherModel(model_config(**kw)).eval()
        prompt = np.random.default_rng(0).integers(0, 256, args.prompt)
        sample_ids(model, prompt, max_new=8, stop=(), seed=0)  # warm up both paths
        sample_ids(model, prompt, max_new=2, stop=(), seed=0, cache=False)
        fast, a = ids_per_second(model, prompt, args.new, True)
        slow, b = ids_per_second(model, prompt, args.new, False)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(
            f"{name}: cached/uncached {fast / slow:.1f}x  ({fast:.0f} vs {slow:.1f} ids/s; "
            f"the first {same} of {len(a)} ids agree)",
            flush=True,
        )
        if model.cfg.attention.kind == "mla":
            speed = {}
            for absorb in (True, False):
                for layer in model.modules():
                    if hasattr(layer, "absorb"):
                        layer.absorb = absorb
                speed[absorb] = ids_per_second(model, prompt, args.new, True)[0]
            print(
                f"{name} decode: absorb/expand {speed[True] / speed[False]:.2f}x  "
                f"({speed[True]:.0f} vs {speed[False]:.0f} ids/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
