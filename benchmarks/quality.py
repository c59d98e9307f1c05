"""Quality per compute: held-out bits per byte that each architecture reaches for the same compute budget, trained
through cipher_nb's own loop on the embedded standard-library corpus.

    python benchmarks/quality.py                              # 5 contenders, 1 seed, 800 CPU-seconds each
    python benchmarks/quality.py --contenders minimal-gpt,dense,moe --budget 90s --seeds 3   # against the baseline
    python benchmarks/quality.py --seeds 3 --jobs 2           # the spread over 3 seeds, two runs at a time
    python benchmarks/quality.py --contenders dense,moe --seeds 6 --sequential  # seeds one at a time until decided
    python benchmarks/quality.py --budget 60 schedule.lr=2e-3 # a quick ranking of one change (to every contender)
    python benchmarks/quality.py --calibrate-only             # just the step-cost table
    python benchmarks/quality.py --config examples/configs/tiny-cpu-90s.yaml --plan budget --budget 90s --seeds 3 \
        --contenders minimal-gpt,dense,moe,dense+muon,moe+muon   # AdamW against Muon for the hidden matrices

Contenders (all built from the same config: the defaults, i.e. `tiny-cpu`, or `--config`, plus any `a.b=c` overrides):
  minimal-gpt  the outside baseline, benchmarks/minimal_gpt.py: a from-scratch byte-level GPT trained with its own
             recipe (4 x 128, context 64, batch 12 x 64, AdamW 1e-3, warmup + cosine) on the base config's loader;
             the reference of the comparison ("vs minimal-gpt")
  dense      a GPT with the MoE's active path as FFN: model.moe.n_routed=0, so d_ff = (top_k + n_shared) * expert_d_ff
  moe        the config itself
  moe+bp     the MoE with the byte-level boundary predictor (model.boundary.enabled=true)
  recurrent  the MoE with a recurrent-depth core: 1 prelude layer, n_layers - 2 core layers looped twice, 1 coda layer
  dense+muon, moe+muon  dense / moe trained with optim.name=muon (Muon for the hidden matrices, AdamW for the rest)
  moe+muonx  moe+muon with the routed experts on Muon too, one matrix per expert (optim.muon_experts=true)
  recurrent+act, +lti, +lora, +engram  the recurrent contender with one piece of the recurrent byte model on: ACT
             halting, the stable LTI injection, per-loop LoRA (rank 4), Engram memory read by every core layer;
             pieces combine (recurrent+act+engram)
  moe+sp     the MoE with shared-projection experts (one shared SwiGLU of twice an expert's width, low-rank factors)
  mla        the MoE with multi-head latent attention in place of grouped-query attention
  dense+engram, moe+engram  dense / moe with Engram memory read by every layer but the first and the last

Two phases. First the step costs, side by side in this one process: every contender's trainer is built (its MoE past
the first steps' solved shift, which a run pays only over its first `model.moe.center_steps`), warmed up, then timed
in `--rounds` interleaved rounds of `--round-steps` training steps each (the order rotates every round), on `--threads`
torch threads, and each contender's cost is the median of its rounds. `--clock cpu` (default) is the
process's CPU time, `--clock wall` elapsed time. The budget (`--budget`: seconds, or "90s", "8m", "2h") then buys each
contender `budget / cost` steps, and each trains exactly that many (its own process, its cosine schedule ending at its
last step), so the held-out figures do not depend on how busy the machine was during training: a run that happened to
share its core would otherwise get fewer steps and a worse score. Every run also reports the clock time its training
really used, as a cross-check, and the report warns when the contenders' median spends differ by more than
`SPEND_GAP` (a calibration that misread a step gives no equal-time verdict). With `--plan budget` the cipher_nb
contenders instead get `schedule.time_budget` and their trainer plans the steps from the cost it measures as it runs
(on `--clock`), the way `cipher-train --time-budget` does; the minimal GPT keeps its calibrated steps, and each run's
line says how close its training time landed.
Held-out bits per byte come only from `cipher_nb.monitor.metrics.heldout_metrics` on the base config's held-out split
(nats
over real bytes, specials excluded, / ln 2), at `--eval-points` points along the steps, each contender at the length
it trained at: its held-out rows are as long as its training rows (training.seq_len; the minimal GPT's context, 64),
and it gets as many rows as make the bytes of `--eval-batches` base batches, so a model is never asked to use more
context than it was trained with. The minimal GPT is scored by that same function through `minimal_gpt.HeldoutView`
(its byte ids). Peak RSS is each run's own process's high-water mark (VmHWM; a child's ru_maxrss would inherit the
parent's peak on Linux). The tables give each contender's per-seed differences from the minimal GPT and
from dense (a seed fixes the data order for all of them), each such pair's verdict ("A better", "B better" or "cannot
tell at this budget with N seeds", from a 95% t interval on the mean per-seed difference: cipher_nb.eval.verdict),
and a table of every seed. With `--sequential`, `--seeds N` is the most seeds it may spend: it adds seeds one at a time
and stops once every pair's `sequential_verdict` (planned for N looks, each at its Bonferroni share of the 5%) is
decided, and the verdicts state that sequential interval.
Writes `--out`.md (the tables), `--out`.json (every run, with its curve) and `--out`.png (held-out bpb vs seconds).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # minimal_gpt, also when this file is loaded by path (the tests)
BASELINE = "minimal-gpt"
RECURRENT_PARTS = {  # the recurrent core's optional pieces, each a contender `recurrent+NAME` (or several: +act+lti)
    "act": ["model.recurrence.halting=true"],
    "lti": ["model.recurrence.injection=lti"],
    "lora": ["model.recurrence.loop_lora_rank=4"],
    "engram": None,  # the core's layers read the memory: built from the config in contender_overrides
}
CONTENDERS = (
    *(BASELINE, "dense", "moe", "moe+bp", "recurrent", "dense+muon", "moe+muon", "moe+muonx"),
    *(f"recurrent+{p}" for p in RECURRENT_PARTS),
    *("moe+sp", "mla", "dense+engram", "moe+engram"),
)
DEFAULT_CONTENDERS = CONTENDERS[:5]  # the optimizer variants run when named
REFS = (BASELINE, "dense")  # the per-seed differences the table reports


def parse_budget(text) -> float:
    "Seconds in `text`: a number of seconds or a duration such as '90s', '8m', '2h'."
    from cipher_nb.config.load import ConfigError, parse_duration

    try:
        return parse_duration(str(text).strip().lower())
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def contender_overrides(name: str, cfg) -> list:
    "The `a.b=c` overrides that turn the base config into contender `name`."
    m = cfg.model
    if name == BASELINE:
        return []  # built from the base config's data only (see contender_trainer)
    if name == "dense":
        return ["model.moe.n_routed=0"]
    if name == "moe":
        return []
    if name == "moe+bp":
        return ["model.boundary.enabled=true"]
    if name in ("dense+muon", "moe+muon", "moe+muonx"):
        experts = ["optim.muon_experts=true"] if name == "moe+muonx" else []
        return [*contender_overrides(name.split("+")[0], cfg), "optim.name=muon", *experts]
    if name == "moe+sp":  # shared-projection experts: one shared SwiGLU of twice an expert's width, rank-16 factors
        return ["model.moe.kind=shared_projection", f"model.moe.shared_inter={2 * m.moe.expert_d_ff}"]
    if name == "mla":  # latent attention in place of grouped-query attention, at the same head count and width
        return ["model.attention.kind=mla"]
    if name in ("dense+engram", "moe+engram"):  # the memory read by every layer but the first and the last
        mid = ", ".join(map(str, range(1, m.n_layers - 1)))
        return [*contender_overrides(name.split("+")[0], cfg), f"model.engram.layers=[{mid}]"]
    if name.startswith("recurrent+"):
        out = contender_overrides("recurrent", cfg)
        for part in name.split("+")[1:]:
            if part not in RECURRENT_PARTS:
                raise SystemExit(f"unknown recurrent part '{part}': choose from {', '.join(RECURRENT_PARTS)}")
            core = list(range(1, m.n_layers - 1))
            out += RECURRENT_PARTS[part] or [f"model.engram.layers=[{', '.join(map(str, core))}]"]
        return out
    if name == "recurrent":
        if m.n_layers < 3:
            raise SystemExit(f"the recurrent contender needs model.n_layers >= 3 (got {m.n_layers})")
        return [
            "model.recurrence.n_prelude=1",
            f"model.recurrence.n_core={m.n_layers - 2}",
            "model.recurrence.n_coda=1",
            "model.recurrence.n_loops=2",
        ]
    raise SystemExit(f"unknown contender '{name}': choose from {', '.join(CONTENDERS)}")


def budgeted(a, name: str) -> bool:
    "Whether contender `name` plans its own steps with `schedule.time_budget` (`--plan budget`, cipher_nb contenders)."
    return a.plan == "budget" and name != BASELINE


def contender_trainer(a, name: str, seed: int, steps: int, run_dir: Path):
    "A trainer for contender `name` (no checkpoints, record, monitor, callbacks but MoE balancing) and its overrides."
    from cipher_nb.config.load import load_config

    if name == BASELINE:
        from minimal_gpt import MinimalTrainer

        from cipher_nb.data.curriculum import build_loader

        over = [*a.overrides, f"training.seed={seed}"]
        cfg = load_config(a.config, over)  # the base config: its training documents, in this seed's order
        tr = MinimalTrainer(
            build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1), steps, seed
        )
        tr.cfg = cfg
        return tr, over
    from cipher_nb.train.builder import BoundarySchedule, MoEBalancing, build_trainer

    over = [*a.overrides, *contender_overrides(name, load_config(a.config, a.overrides)), f"training.seed={seed}"]
    if budgeted(a, name):  # the trainer plans the steps that fit the budget, on this script's clock
        from cipher_nb.train.builder import BUDGET_MAX_STEPS

        plan = [f"schedule.time_budget={a.budget:g}s", f"schedule.max_steps={BUDGET_MAX_STEPS}"]
    else:
        plan = [f"schedule.max_steps={steps}"]
    cfg = load_config(a.config, [*over, *plan])
    tr = build_trainer(cfg, run_dir, progress=False)
    tr.schedule.clock = time.process_time if a.clock == "cpu" else time.perf_counter
    if not budgeted(a, name):  # the calibration planned these steps: nothing waits for the time budget's plan
        tr.schedule.planned = True  # (the MoE's first-steps shift does; only Trainer.fit, not this loop, would make it)
    tr.checkpoints = None
    keep = (MoEBalancing, BoundarySchedule)  # the step keeps its bias balancing and its boundary predictor's schedule
    tr.callbacks = [cb for cb in tr.callbacks if isinstance(cb, keep)]
    tr.model.train()
    return tr, over


def fit_step(tr):
    "One training step between the callbacks' `before_step` and `after_step`, as `Trainer.fit` runs it."
    from cipher_nb.callbacks import run_callbacks

    callbacks = getattr(tr, "callbacks", ())  # the minimal GPT has none
    run_callbacks(callbacks, "before_step", tr)  # the boundary predictor's mode; a skipped step's counts dropped
    res = tr.train_step()
    if res is not None:  # as in Trainer.fit: a skipped step moves no balancing bias
        run_callbacks(callbacks, "after_step", tr)
    return res


def heldout_overrides(base, seq_len: int) -> list:
    "Overrides of the base config that give held-out rows of `seq_len` covering the bytes of its eval batches."
    t = base.training
    n = -(-t.eval_batches * t.seq_len // seq_len)  # ceil: the same held-out bytes in rows of the trained length
    return [f"training.seq_len={seq_len}", f"training.eval_batches={n}"]


def trained_length(name: str, cfg) -> int:
    "The row length contender `name` trained at: the minimal GPT's context, else its config's training.seq_len."
    if name == BASELINE:
        from minimal_gpt import CONTEXT

        return CONTEXT
    return cfg.training.seq_len


def peak_rss_gb() -> float:
    "This process's own peak resident set in GB: VmHWM on Linux (ru_maxrss survives exec, so a child would inherit it)."
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) * 1024 / 1e9
    except (OSError, StopIteration):
        from cipher_nb.monitor.metrics import mem_gb

        return mem_gb("cpu")


# The calibration times the step a run takes for nearly all its steps. An MoE's first `center_steps` steps also solve
# their balance shift (10 more top-k passes per block), but only in plans of at least CENTER_PLAN x center_steps steps,
# where they are a small share; the calibration's million-step plan would time that solve in every round.
STEADY = ["model.moe.center_steps=0"]


def calibration_trainer(a, name: str, run_dir: Path):
    "Contender `name`'s trainer as the calibration times it: a long plan, past the MoE's first steps' solved shift."
    return contender_trainer(
        argparse.Namespace(**{**vars(a), "overrides": [*a.overrides, *STEADY]}), name, 0, 10**6, run_dir
    )[0]


def calibrate(a, names: list) -> dict:
    "Seconds per training step of each contender: median of interleaved timed rounds in this process."
    import torch

    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    times = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        trs = {n: calibration_trainer(a, n, Path(tmp) / n) for n in names}
        for tr in trs.values():
            for _ in range(a.round_steps):
                fit_step(tr)  # warm-up: allocator, caches, first-call paths
        for r in range(a.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                c0 = clock()
                for _ in range(a.round_steps):
                    fit_step(trs[n])
                times[n].append((clock() - c0) / a.round_steps)
    return {n: statistics.median(ts) for n, ts in times.items()}


def run_one(a) -> dict:
    "Train one contender for one seed for its `--steps` (or its own plan for the budget); return numbers and curve."
    import torch

    torch.set_num_threads(a.threads)
    from minimal_gpt import HeldoutView, n_params

    from cipher_nb.config.load import load_config
    from cipher_nb.config.sizing import param_counts
    from cipher_nb.data.codecs import build_codec
    from cipher_nb.data.curriculum import build_loader
    from cipher_nb.monitor.metrics import heldout_metrics

    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        tr, over = contender_trainer(a, a.one, a.seed, a.steps, Path(tmp) / "run")
        base = load_config(
            a.config, [*a.overrides, *([f"training.eval_batches={a.eval_batches}"] * bool(a.eval_batches))]
        )
        # the BASE config's held-out split (same data for every contender), in rows of this contender's trained length
        eval_len = trained_length(a.one, tr.cfg)
        hcfg = load_config(a.config, [*a.overrides, *heldout_overrides(base, eval_len)])
        heldout = list(
            islice(
                iter(build_loader(hcfg.data, hcfg.training, hcfg.schedule, hcfg.model.vocab, "heldout", 0, 1)),
                hcfg.training.eval_batches,
            )
        )
        lengths = torch.as_tensor(build_codec(tr.cfg.data).byte_lengths)
        scored = HeldoutView(tr.model) if a.one == BASELINE else tr.model

        def ev():
            tr.model.eval()
            try:
                return heldout_metrics(scored, heldout, lengths, tr.device, tr.dtype)["val/bpb"]
            finally:
                tr.model.train()

        used, wall0, curve = 0.0, time.perf_counter(), []
        if budgeted(a, a.one):  # as Trainer.fit does: time each step, re-plan, stop when the plan is done
            marks, nth = [a.budget * (i + 1) / a.eval_points for i in range(a.eval_points - 1)], 0
            plan = tr.schedule
            while tr.step < plan.max_steps:
                c0, nth = clock(), nth + 1
                fit_step(tr)
                plan.record_step_time(clock() - c0, nth)
                plan.replan(tr.step)
                if tr.step == plan.max_steps or (marks and plan.train_seconds >= marks[0]):
                    marks = [m for m in marks if m > plan.train_seconds]
                    curve.append(dict(seconds=round(plan.train_seconds, 2), step=tr.step, bpb=ev()))
            used = plan.train_seconds
        else:
            points = sorted({max(1, round(a.steps * (i + 1) / a.eval_points)) for i in range(a.eval_points)})
            while tr.step < a.steps:
                c0 = clock()
                fit_step(tr)
                used += clock() - c0
                if tr.step in points:
                    curve.append(dict(seconds=round(tr.step * a.cost, 2), step=tr.step, bpb=ev()))
        cfg = tr.cfg
        pc = dict.fromkeys(("total", "active"), n_params(tr.model)) if a.one == BASELINE else param_counts(cfg.model)
        return dict(
            name=a.one,
            seed=a.seed,
            clock=a.clock,
            threads=a.threads,
            budget=a.budget,
            cost=a.cost,
            seconds=used if budgeted(a, a.one) else a.steps * a.cost,
            used=used,
            plan=a.plan if a.one != BASELINE else "steps",
            wall=time.perf_counter() - wall0,
            steps=tr.step,
            tokens=tr.tokens,
            tok_per_s=tr.tokens / (used if budgeted(a, a.one) else a.steps * a.cost),
            bpb=curve[-1]["bpb"],
            curve=curve,
            params=pc["total"],
            active=pc["active"],
            peak_gb=peak_rss_gb(),
            eval_len=eval_len,
            overrides=over,
        )


def _mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def cost_table(costs: dict, budget: float, clock: str, threads: int) -> str:
    "The calibration: each contender's step cost, its ratio to the references and the steps the budget buys it."
    refs = [r for r in REFS if r in costs]
    lines = [
        f"step cost ({clock} clock, {threads} torch thread(s), median of interleaved rounds in one process):",
        "",
        "| contender | ms per step | " + "".join(f"vs {r} | " for r in refs) + "steps in the budget |",
        "|---|---|" + "---|" * len(refs) + "---|",
    ]
    for n, c in costs.items():
        ratios = "".join(f"{c / costs[r]:.2f}x | " for r in refs)
        lines.append(f"| {n} | {c * 1e3:.1f} | {ratios}{int(budget / c)} |")
    return "\n".join(lines)


def paired(rs: list, ref: list) -> list:
    "Per-seed differences `rs - ref` over the seeds both have (a seed gives every contender the same data order)."
    by_seed = {r["seed"]: r["bpb"] for r in ref}
    return [r["bpb"] - by_seed[r["seed"]] for r in rs if r["seed"] in by_seed]


def _vs(rs: list, ref: list) -> tuple:
    "The two cells of one reference: mean per-seed difference ± its spread, and on how many seeds it is ahead."
    d = paired(rs, ref)
    if not d:
        return "", ""
    dm, dsd = _mean_sd(d)
    return (f"{dm:+.4f} ± {dsd:.4f}" if len(d) > 1 else f"{dm:+.4f}"), f"{sum(x < 0 for x in d)}/{len(d)} seeds"


def table(runs: list, names: list) -> str:
    "The side-by-side table: mean over seeds with its spread, the per-seed difference from dense and the minimal GPT."
    by = {n: [r for r in runs if r["name"] == n] for n in names}
    r0 = runs[0]
    lines = [
        f"budget {r0['budget']:g} {r0['clock']}-s per run ({r0['threads']} torch thread(s)), "
        f"seeds per contender: {len(by[names[0]])}"
        + ("; cipher_nb steps planned by schedule.time_budget" if any(r.get("plan") == "budget" for r in runs) else ""),
        "",
        "| contender | held-out bpb | vs dense, same seed | ahead of dense | vs minimal-gpt, same seed "
        "| ahead of minimal-gpt | held-out rows (= trained length) | steps | tok/s | params (total) | params (active) "
        "| peak RSS GB (own process) | clock-s used |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        rs = by[n]
        m, sd = _mean_sd([r["bpb"] for r in rs])
        bpb = f"{m:.4f} ± {sd:.4f}" if len(rs) > 1 else f"{m:.4f}"
        vs_dense = _vs(rs, by.get("dense", [])) if n != "dense" else ("", "")
        vs_base = _vs(rs, by.get(BASELINE, [])) if n != BASELINE else ("", "")
        steps = sorted({r["steps"] for r in rs})  # one count under a calibrated plan; per seed under a budget
        steps = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        lines.append(
            f"| {n} | {bpb} | {' | '.join(vs_dense)} | {' | '.join(vs_base)} | {rs[0].get('eval_len', '')} | {steps} | "
            f"{statistics.mean(r['tok_per_s'] for r in rs):,.0f} | "
            f"{rs[0]['params'] / 1e6:.2f}M | {rs[0]['active'] / 1e6:.2f}M | {max(r['peak_gb'] for r in rs):.2f} | "
            f"{statistics.mean(r['used'] for r in rs):.0f} |"
        )
    lines.append("")
    lines.append(
        "(held-out bpb: mean ± sample standard deviation over seeds; vs dense / vs minimal-gpt: the mean over seeds "
        "of the contender minus the reference on the same seed, ± the standard deviation of that difference: a seed "
        "fixes the data order, which moves every contender alike, so this is the spread to weigh a gap against; "
        "held-out rows: every contender is scored on the same held-out bytes cut into rows of the length it trained "
        "at; peak RSS: the high-water mark of the run's own process; "
        "tok/s counts bytes and specials per budget second; clock-s used is what training took in its own process, "
        "the cross-check of the step cost)"
    )
    return "\n".join(lines)


def ref_pairs(names: list) -> list:
    "(contender, reference) for each reference present and each other contender, each pair once."
    return [(n, ref) for ref in REFS if ref in names for n in names if n not in (ref, *REFS[: REFS.index(ref)])]


def pair_verdicts(runs: list, names: list, max_seeds: int = 0) -> list:
    "Each (contender, reference) pair's verdict over the seeds both ran; with `max_seeds`, a sequential one."
    from cipher_nb.eval.verdict import paired_verdict, sequential_verdict

    bpb = {(r["name"], r["seed"]): r["bpb"] for r in runs}
    out = []
    for n, ref in ref_pairs(names):
        seeds = sorted(s for m, s in bpb if m == n and (ref, s) in bpb)
        if not seeds:
            continue
        a, b = [bpb[n, s] for s in seeds], [bpb[ref, s] for s in seeds]
        out.append(sequential_verdict(a, b, max_seeds, (n, ref)) if max_seeds else paired_verdict(a, b, (n, ref)))
    return out


def all_decided(runs: list, names: list, max_seeds: int) -> bool:
    "Whether a sequential comparison may stop: every pair has a verdict (or the planned seeds are spent)."
    vs = pair_verdicts(runs, names, max_seeds)
    return bool(vs) and all(v["stop"] for v in vs)


def verdict_table(runs: list, names: list, max_seeds: int = 0) -> str:
    "Per (contender, reference): the mean per-seed difference, its t interval, the sign per seed and the verdict."
    from cipher_nb.eval.verdict import look_level, verdict_line

    how = "95% t interval on the mean"
    if max_seeds:  # the interval that stays valid however many of the planned looks were taken
        how = f"sequential, planned for {max_seeds} seeds: each look's {look_level(0.95, 2, max_seeds):.2%} t interval"
    lines = [f"verdicts (held-out bpb, contender - reference over the seeds both ran; {how}):", ""]
    lines += [f"- {verdict_line(v)}" for v in pair_verdicts(runs, names, max_seeds)]
    return "\n".join(lines) if len(lines) > 2 else ""  # no pair ran on a common seed: no section


SPEND_GAP = 0.10  # contenders whose runs' median spends differ by more than this did not get equal time


def spend_note(runs: list, names: list) -> str:
    "A warning when the contenders' runs used unequal shares of the budget (a misread calibration), else ''."
    spend = {
        n: statistics.median(r["used"] / r["budget"] - 1 for r in runs if r["name"] == n)
        for n in names
        if any(r["name"] == n for r in runs)
    }
    if not spend or max(spend.values()) - min(spend.values()) <= SPEND_GAP:
        return ""
    hi, lo = max(spend, key=spend.get), min(spend, key=spend.get)
    return (
        f"unequal time: {hi}'s runs used {spend[hi]:+.0%} of the budget (median), {lo}'s {spend[lo]:+.0%}: the "
        f"calibration read {hi}'s step low, or its runs shared the cores unevenly. Re-run with nothing else on the "
        "machine, or plan by the budget (--plan budget), before reading the verdict as one at equal time."
    )


def seed_table(runs: list, names: list) -> str:
    "Every seed on its own line: each contender's held-out bpb and each one's difference from the references."
    bpb = {(r["name"], r["seed"]): r["bpb"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    diffs = ref_pairs(names)
    lines = [
        "per seed (held-out bpb; a difference below 0: the first contender is ahead):",
        "",
        "| " + " | ".join(["seed", *names, *(f"{n} - {ref}" for n, ref in diffs)]) + " |",
        "|---|" + "---|" * (len(names) + len(diffs)),
    ]
    for s in seeds:
        cells = [f"{bpb[n, s]:.4f}" if (n, s) in bpb else "" for n in names]
        cells += [f"{bpb[n, s] - bpb[ref, s]:+.4f}" if (n, s) in bpb and (ref, s) in bpb else "" for n, ref in diffs]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list, names: list, path: Path):
    "Held-out bpb against clock seconds, one colour per contender, one line per seed."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, n in enumerate(names):
        for j, r in enumerate(x for x in runs if x["name"] == n):
            xs, ys = [p["seconds"] for p in r["curve"]], [p["bpb"] for p in r["curve"]]
            ax.plot(xs, ys, marker="o", ms=3, color=f"C{i}", alpha=0.9 if j == 0 else 0.5, label=n if j == 0 else None)
    r0 = runs[0]
    ax.set_xlabel(
        f"{'CPU' if r0['clock'] == 'cpu' else 'wall-clock'} seconds: "
        f"steps x measured step cost ({r0['threads']} torch thread(s))"
    )
    ax.set_ylabel("held-out bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("cipher_nb quality per compute (stdlib corpus)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every contender")
    p.add_argument("--config", default=None, help="a YAML preset (default: the config defaults = tiny-cpu)")
    p.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help="comma-separated subset of " + ", ".join(CONTENDERS),
    )
    p.add_argument(
        "--budget",
        type=parse_budget,
        default=800.0,
        help="clock seconds of training per run, or a duration: 90s, 8m, 2h (800: about the CPU time of the default "
        "cipher-train run)",
    )
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu: process CPU time; wall: elapsed time")
    p.add_argument("--threads", type=int, default=1, help="torch threads (calibration and runs)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per contender")
    p.add_argument("--round-steps", type=int, default=4, help="training steps per timing round")
    p.add_argument(
        "--plan",
        choices=("steps", "budget"),
        default="steps",
        help="steps: every contender trains budget / (its calibrated step cost) steps; budget: the cipher_nb "
        "contenders get schedule.time_budget and their trainer plans the steps as it runs (on --clock), the "
        "minimal GPT keeps its calibrated steps",
    )
    p.add_argument("--calibrate-only", action="store_true", help="print the step-cost table and stop")
    p.add_argument("--seeds", type=int, default=1, help="seeds per contender (0, 1, ...)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="add seeds one at a time and stop once every pair against a reference is decided (--seeds: the most)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="training runs at once (their step counts are fixed, so sharing cores does not change the scores)",
    )
    p.add_argument("--eval-points", type=int, default=6, help="held-out evaluations along the steps")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=0,
        help="held-out batches (the same for every contender; 0: the config's training.eval_batches)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/quality"), help="output prefix (.md, .json, .png)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one contender in this process
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cost", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        Path(a.json).write_text(json.dumps(run_one(a)))
        return
    names = [n.strip() for n in a.contenders.split(",") if n.strip()]
    for flag, v in (("--jobs", a.jobs), ("--seeds", a.seeds), ("--rounds", a.rounds), ("--round-steps", a.round_steps)):
        if v < 1:  # --jobs 0 would wait forever for a free slot
            p.error(f"{flag} must be at least 1, got {v}")
    if a.threads < 1 or a.eval_points < 1:
        p.error(f"--threads and --eval-points must be at least 1, got {a.threads} and {a.eval_points}")
    if a.sequential and a.seeds < 2:
        p.error("--sequential needs --seeds 2 or more: the most seeds it may spend")
    if a.sequential and not ref_pairs(names):
        p.error(f"--sequential needs a reference ({' or '.join(REFS)}) and another contender to decide between")
    for n in names:
        if n not in CONTENDERS and not n.startswith("recurrent+"):  # recurrent parts combine: checked when built
            p.error(f"unknown contender '{n}': choose from {', '.join(CONTENDERS)}")
    costs = calibrate(a, names)
    ctext = cost_table(costs, a.budget, a.clock, a.threads)
    print(ctext + "\n", flush=True)
    if a.calibrate_only:
        return
    from cipher_nb.config.load import load_config

    warmup = load_config(a.config, a.overrides).schedule.warmup_steps
    short = [n for n in names if not budgeted(a, n) and n != BASELINE and int(a.budget / costs[n]) <= warmup]
    if short:
        sys.exit(
            f"--budget {a.budget:g} buys {', '.join(f'{n} {int(a.budget / costs[n])}' for n in short)} steps, "
            "not more than "
            f"schedule.warmup_steps ({warmup}): raise --budget or lower schedule.warmup_steps"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="quality-"))
    base = [
        sys.executable,
        __file__,
        *a.overrides,
        "--budget",
        str(a.budget),
        "--clock",
        a.clock,
        "--threads",
        str(a.threads),
        "--eval-points",
        str(a.eval_points),
        "--eval-batches",
        str(a.eval_batches),
        "--plan",
        a.plan,
    ]
    if a.config:
        base += ["--config", a.config]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    running, runs = [], []

    def reap(block: bool):
        for job in list(running):
            (n, s, j, proc) = job
            if block or proc.poll() is not None:
                if proc.wait() != 0:
                    sys.exit(f"{n} seed {s} failed (exit {proc.returncode})")
                r = json.loads(j.read_text())
                runs.append(r)
                running.remove(job)
                print(
                    f"{n:>10} seed {s}: bpb {r['bpb']:.4f} after {r['steps']} steps "
                    f"({r['used']:.0f} {a.clock}-s used, {r['used'] / a.budget - 1:+.1%} of the budget, "
                    f"{r['wall']:.0f} wall-s)",
                    flush=True,
                )
                if not block:
                    return

    for s in range(a.seeds):
        for n in names:
            while len(running) >= a.jobs:
                reap(False)
                time.sleep(0.5)
            j = tmp / f"{n}-{s}.json"
            cmd = [
                *base,
                "--one",
                n,
                "--seed",
                str(s),
                "--steps",
                str(int(a.budget / costs[n])),
                "--cost",
                repr(costs[n]),
                "--json",
                str(j),
            ]
            running.append((n, s, j, subprocess.Popen(cmd, env=env)))
        if a.sequential:  # look after each seed: stop once every pair is decided
            while running:
                reap(True)
            print(verdict_table(runs, names, a.seeds), flush=True)
            if s + 1 < a.seeds and all_decided(runs, names, a.seeds):  # at the last seed it ends anyway
                print(f"every pair decided after {s + 1} of {a.seeds} planned seeds: stopped", flush=True)
                break
    while running:
        reap(True)
    runs.sort(key=lambda r: (names.index(r["name"]), r["seed"]))
    cmd = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    verdicts = verdict_table(runs, names, a.seeds if a.sequential else 0)
    text = f"`{cmd}`\n\n{ctext}\n\n" + table(runs, names) + (f"\n\n{verdicts}" if verdicts else "")
    note = spend_note(runs, names)
    text += f"\n\n**{note}**" if note else ""
    text += "\n\n" + seed_table(runs, names)
    print("\n" + text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(command=cmd, costs=costs, runs=runs), indent=1))
    plot(runs, names, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.md')}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
