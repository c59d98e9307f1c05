"""Plain routed experts against shared-projection experts (`model.moe.kind = shared_projection`) at equal parameters
and at equal active FLOPs: MoE block step time on CPU, and held-out bits per byte at equal CPU time.

    OMP_NUM_THREADS=1 python benchmarks/spmoe.py --block-only            # block step times, about a minute
    OMP_NUM_THREADS=1 python benchmarks/spmoe.py --budget 60 --seeds 1 --jobs 2   # plus the quality runs

Contenders, all on the base config (`--config`, default examples/configs/tiny-cpu-90s.yaml), differing only in the
routed experts; the shared projection's sizes are derived from the base config's experts (`sp_sizes`):
  routed      the config itself: n_routed SwiGLU experts of width expert_d_ff, top_k active
  sp-params   shared projection of rank 3/16 of the expert width, its width chosen for the routed experts' parameter
              count, at several times their active FLOPs (the shared projection runs for every token)
  sp-flops    shared projection of rank 1/8 of the expert width, its width chosen for the routed experts' active
              FLOPs per token, at a fraction of their parameters
The report's first table gives each contender's parameters and FLOPs against routed's.

Block step time: forward + backward of one `MoE` block (loss `(y * g).sum()`), process CPU time, median of
interleaved rounds in this process, at the preset's step (12 x 64 tokens) and at the default tiny-cpu step
(16 x 256). Quality: `benchmarks/quality.py`'s machinery (its contender `moe` with each contender's overrides): step
costs calibrated side by side in this process, then each contender trains `budget / cost` steps in its own process
(`quality.py --one`), and is scored on the base config's held-out split. Prints a markdown report.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def sp_sizes(cfg, match: str) -> tuple:
    "(shared_inter, expert_rank) of a shared projection matching the routed experts' 'params' or active 'flops'."
    m, e = cfg.model, cfg.model.moe
    d, h = m.d_model, e.expert_d_ff
    # shared width s and rank r cost 3*d*s + n*3*r*(d + s) per token or in all (n: top_k or n_routed); solve for s
    n, r = (e.n_routed, max(1, round(3 * h / 16))) if match == "params" else (e.top_k, max(1, round(h / 8)))
    return max(1, round(n * d * (h - r) / (d + n * r))), r


def contenders(cfg) -> dict:
    "Each contender's overrides on the base config `cfg` (routed experts)."
    out = {"routed": []}
    for name, match in (("sp-params", "params"), ("sp-flops", "flops")):
        s, r = sp_sizes(cfg, match)
        out[name] = ["model.moe.kind=shared_projection", f"model.moe.shared_inter={s}", f"model.moe.expert_rank={r}"]
    return out


STEPS = {"tiny-cpu-90s step (12 x 64)": (12, 64), "tiny-cpu step (16 x 256)": (16, 256)}


def moe_sizes(cfg) -> tuple:
    "(total, active) parameters of one MoE block's routed experts (router and shared experts excluded)."
    m, e = cfg.model, cfg.model.moe
    shared, per = (0, 3 * m.d_model * e.expert_d_ff) if e.kind == "routed" else (
        3 * m.d_model * e.shared_inter, 3 * e.expert_rank * (m.d_model + e.shared_inter))  # fmt: skip
    return shared + e.n_routed * per, shared + e.top_k * per


def block_times(cfgs: dict, rounds: int, reps: int) -> dict:
    "Median CPU seconds of forward + backward of one MoE block per contender and step shape."
    from cipher_nb.model.moe import MoE

    out = {}
    for shape, (B, T) in STEPS.items():
        torch.manual_seed(0)
        blocks = {n: MoE(c.model).train() for n, c in cfgs.items()}
        for n, m in blocks.items():  # the hand count above is the module's
            assert sum(p.numel() for p in m.experts.parameters()) == moe_sizes(cfgs[n])[0], n
        x = torch.randn(B, T, next(iter(cfgs.values())).model.d_model)
        g = torch.randn_like(x)

        def step(m):
            xi = x.clone().requires_grad_()
            y, aux, _ = m(xi)
            ((y * g).sum() + sum(aux.values())).backward()
            m.zero_grad(set_to_none=True)

        for m in blocks.values():
            step(m)
        times = {n: [] for n in blocks}
        names = list(blocks)
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                c0 = time.process_time()
                for _ in range(reps):
                    step(blocks[n])
                times[n].append((time.process_time() - c0) / reps)
        out[shape] = {n: statistics.median(ts) for n, ts in times.items()}
    return out


def quality_args(a, overrides: list, **kw) -> argparse.Namespace:
    "The namespace `quality.py` builds from its command line, for one contender's overrides."
    return argparse.Namespace(
        config=a.config,
        overrides=[*a.overrides, *overrides],
        plan="steps",
        budget=a.budget,
        clock="cpu",
        threads=1,
        eval_batches=0,
        eval_points=a.eval_points,
        **kw,
    )


def calibrate(a, cfg_over: dict) -> dict:
    "Seconds per training step of each contender, interleaved in this process (quality.py's way)."
    import quality

    times = {n: [] for n in cfg_over}
    with tempfile.TemporaryDirectory() as tmp:
        trs = {
            n: quality.contender_trainer(quality_args(a, o), "moe", 0, 10**6, Path(tmp) / n)[0]
            for n, o in cfg_over.items()
        }
        for tr in trs.values():
            for _ in range(a.round_steps):
                quality.fit_step(tr)
        names = list(trs)
        for r in range(a.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                c0 = time.process_time()
                for _ in range(a.round_steps):
                    quality.fit_step(trs[n])
                times[n].append((time.process_time() - c0) / a.round_steps)
    return {n: statistics.median(ts) for n, ts in times.items()}


def quality_runs(a, costs: dict, over: dict) -> list:
    "Each contender and seed trained for `budget / cost` steps by `quality.py --one`, `--jobs` at a time."
    tmp, runs, queue, running = Path(tempfile.mkdtemp(prefix="spmoe-")), [], [], []
    for s in range(a.seeds):
        for n, o in over.items():
            j = tmp / f"{n}-{s}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks/quality.py"), *a.overrides, *o, "--budget", str(a.budget)]
            cmd += ["--eval-points", str(a.eval_points), "--one", "moe", "--seed", str(s)]
            cmd += ["--steps", str(int(a.budget / costs[n])), "--cost", repr(costs[n]), "--json", str(j)]
            queue.append((n, s, j, cmd + (["--config", a.config] if a.config else [])))
    while queue or running:
        while queue and len(running) < a.jobs:
            n, s, j, cmd = queue.pop(0)
            running.append((n, s, j, subprocess.Popen(cmd, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})))
        time.sleep(1)
        for job in [r for r in running if r[3].poll() is not None]:
            running.remove(job)
            n, s, j, proc = job
            if proc.returncode:
                sys.exit(f"{n} seed {s} failed (exit {proc.returncode})")
            r = json.loads(j.read_text()) | {"contender": n}
            print(f"{n} seed {s}: bpb {r['bpb']:.4f} after {r['steps']} steps ({r['wall']:.0f} wall-s)", flush=True)
            runs.append(r)
    return runs


def report(a, cfgs, times, costs=None, runs=None) -> str:
    from cipher_nb.config.sizing import flops_per_token, param_counts

    lines = ["| contender | experts' params | vs routed | experts' active params | vs routed | model params "
             "| model FLOPs/token | vs routed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ref = moe_sizes(cfgs["routed"])
    ref_f = flops_per_token(cfgs["routed"].model, cfgs["routed"].training.seq_len)
    for n, c in cfgs.items():
        tot, act = moe_sizes(c)
        f = flops_per_token(c.model, c.training.seq_len)
        pc = param_counts(c.model)
        lines.append(
            f"| {n} | {tot:,} | {tot / ref[0]:.2f}x | {act:,} | {act / ref[1]:.2f}x | {pc['total']:,} "
            f"| {f:.3g} | {f / ref_f:.2f}x |"
        )
    lines += ["", "MoE block forward + backward, CPU ms (1 thread, median of interleaved rounds):", ""]
    lines += ["| contender | " + " | ".join(times) + " |", "|---|" + "---|" * 2 * len(times)]
    lines[-2] = "| contender | " + " | ".join(f"{s} | vs routed" for s in times) + " |"
    for n in cfgs:
        cells = [f"{times[s][n] * 1e3:.2f} | {times[s][n] / times[s]['routed']:.2f}x" for s in times]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if costs:
        lines += ["", f"Whole training step (quality.py's calibration), CPU ms, and steps in {a.budget:g} CPU-s:", ""]
        lines += ["| contender | ms per step | vs routed | steps |", "|---|---|---|---|"]
        for n, c in costs.items():
            lines.append(f"| {n} | {c * 1e3:.1f} | {c / costs['routed']:.2f}x | {int(a.budget / c)} |")
    if runs:
        lines += ["", "Held-out bits per byte at equal CPU time (lower is better):", ""]
        lines += [
            "| contender | seed | steps | bpb | vs routed (same seed) | peak RSS GB |",
            "|---|---|---|---|---|---|",
        ]
        ref_bpb = {r["seed"]: r["bpb"] for r in runs if r["contender"] == "routed"}
        for r in sorted(runs, key=lambda r: (list(cfgs).index(r["contender"]), r["seed"])):
            d = r["bpb"] - ref_bpb.get(r["seed"], float("nan"))
            lines.append(
                f"| {r['contender']} | {r['seed']} | {r['steps']} | {r['bpb']:.4f} | {d:+.4f} | {r['peak_gb']:.2f} |"
            )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every contender")
    p.add_argument("--config", default=str(ROOT / "examples/configs/tiny-cpu-90s.yaml"))
    p.add_argument("--budget", type=float, default=60.0, help="CPU seconds of training per contender")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2, help="quality runs at a time")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-steps", type=int, default=4)
    p.add_argument("--block-reps", type=int, default=5, help="block steps per timing round")
    p.add_argument("--eval-points", type=int, default=2)
    p.add_argument("--block-only", action="store_true", help="sizes and block step times only")
    a = p.parse_args()
    torch.set_num_threads(1)
    from cipher_nb.config.load import load_config

    over = contenders(load_config(a.config, a.overrides))
    cfgs = {n: load_config(a.config, [*a.overrides, *o]) for n, o in over.items()}
    times = block_times(cfgs, a.rounds, a.block_reps)
    costs = runs = None
    if not a.block_only:
        costs = calibrate(a, over)
        print(report(a, cfgs, times, costs), flush=True)
        runs = quality_runs(a, costs, over)
    cmd = "OMP_NUM_THREADS=1 python benchmarks/spmoe.py " + " ".join(sys.argv[1:])
    print(f"\n`{cmd}` (torch {torch.__version__})\n\n" + report(a, cfgs, times, costs, runs))


if __name__ == "__main__":
    main()
