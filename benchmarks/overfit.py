"""Overfitting on a small corpus: the runbook's fixes (dropout, weight decay on the memory tables, early stopping)
side by side with the 90-second recipe and the minimal GPT, at equal CPU time, at 90 s, 4 and 8 minutes.

    python benchmarks/overfit.py                                  # every contender, 90s / 4m / 8m, 1 seed
    python benchmarks/overfit.py --seeds 3 --jobs 2               # the spread over 3 seeds, two runs at a time
    python benchmarks/overfit.py --budgets 4m --contenders minimal-gpt,recipe,recipe+dropout
    python benchmarks/overfit.py --budgets 3s --eval-points 2 schedule.warmup_steps=2 --out /tmp/overfit  # a smoke run

The corpus: about `--corpus-bytes` (1 MB) of the running Python's standard library (`cipher_nb.data.corpora
.stdlib_files`, tests left out), cut by a fixed rule so every run and every machine with the same Python reads the
same bytes: the files in the order of a hash of their relative path, the first ones up to `--corpus-bytes` for
training, the next ones up to `--heldout-bytes` each for validation (what early stopping watches) and for the test
(what the tables report). Whole files land in one split only, so no held-out byte was trained on, even by a
neighbouring document. The files are copied under `--work`; the runs read them as `data.source=files` with
`data.heldout_path` set to the validation files.

Contenders (each one the base config, `--config`, default the 90-second recipe `examples/configs/tiny-cpu-90s.yaml`,
with its time budget cleared, plus any `a.b=c` overrides given here):
  minimal-gpt        benchmarks/minimal_gpt.py, without dropout: the outside baseline
  recipe             the base config as it is (no dropout, the memory tables undecayed)
  recipe+dropout     model.dropout = `--dropout` (attention's output, the residual branches, Engram's reads)
  recipe+memwd       optim.memory_weight_decay = `--memory-wd` (the Engram tables' own decay)
  recipe+stop        early stopping: `--patience` evaluations without a lower validation bpb end the run, and the
                     weights of its best evaluation are scored (what `final/` holds after a run that stops early)
  recipe+all         all three
Parts combine by name (recipe+dropout+stop, ...).

Each budget is run as benchmarks/quality.py runs one: every contender's step cost is measured side by side in this
process (interleaved rounds, the median), the budget buys it `budget / cost` steps and its cosine schedule ends at
the last one (early stopping can end it sooner). Evaluation time is not counted. At `--eval-points` points along the
steps each run is scored on the validation and test files and on a fixed sample of its training bytes of the test's
size, all in evaluation mode (no dropout): bits per byte from `cipher_nb.monitor.metrics.heldout_metrics`, each model
at the row length it trained at. The gap is test bpb minus training bpb at the end.

Writes `--out`.md (one table per budget, the paired verdict of each fix against the recipe and of the recipe against
the minimal GPT over 2+ seeds, and the winner), `--out`.json (every run, with its curves) and `--out`.png (test bpb
against seconds, one panel per budget).
"""

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # quality and minimal_gpt, also when loaded by path
import quality  # noqa: E402
from bench_args import at_least  # noqa: E402

BASELINE = quality.BASELINE
PARTS = ("dropout", "memwd", "stop")  # the fixes a recipe contender combines: recipe+dropout+stop, recipe+all
DEFAULT_CONTENDERS = (BASELINE, "recipe", "recipe+dropout", "recipe+memwd", "recipe+stop", "recipe+all")
DEFAULT_BUDGETS = "90s,4m,8m"


def contender_parts(name: str) -> tuple:
    "The fixes contender `name` has on (the minimal GPT and the plain recipe: none)."
    if name == BASELINE or name == "recipe":
        return ()
    head, *parts = name.split("+")
    parts = PARTS if parts == ["all"] else tuple(parts)
    if head != "recipe" or not parts or any(p not in PARTS for p in parts):
        raise SystemExit(f"unknown contender '{name}': {BASELINE}, recipe, or recipe+ one or more of {PARTS} (or all)")
    return parts


def contender_overrides(a, name: str) -> list:
    "The overrides of contender `name` on top of the base config (early stopping is the loop's, not a key)."
    parts = contender_parts(name)
    return [f"model.dropout={a.dropout}"] * ("dropout" in parts) + [f"optim.memory_weight_decay={a.memory_wd}"] * (
        "memwd" in parts
    )


def corpus_files() -> list:
    "The standard library's files (tests left out) in a fixed order: by a hash of their path below the library."
    import sysconfig

    from cipher_nb.data.corpora import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])

    def key(p):
        return hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest()

    return sorted(stdlib_files(), key=key)


def cut_corpus(files: list, sizes: dict) -> dict:
    "Split name -> the whole files it takes, in order, until its size in bytes (`sizes`: split -> bytes) is reached."
    out, it = {}, iter(files)
    for split, want in sizes.items():
        out[split], got = [], 0
        while got < want:
            f = next(it, None)
            if f is None:
                raise SystemExit(f"the standard library has too few bytes for the {split} split ({want} wanted)")
            if f.stat().st_size == 0:
                continue
            out[split].append(f)
            got += f.stat().st_size
    return out


def write_corpus(a) -> tuple:
    "Copy the splits under `--work` (once); return (the folder, a manifest: files, bytes and a hash per split)."
    splits = cut_corpus(corpus_files(), dict(train=a.corpus_bytes, val=a.heldout_bytes, test=a.heldout_bytes))
    manifest = {}
    for split, files in splits.items():
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        manifest[split] = dict(files=len(files), bytes=sum(f.stat().st_size for f in files), sha256=h.hexdigest())
    tag = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(a.work) / f"corpus-{tag}"
    if not (root / "COMPLETE").exists():
        shutil.rmtree(root, ignore_errors=True)
        for split, files in splits.items():
            (root / split).mkdir(parents=True)
            for i, f in enumerate(files):
                (root / split / f"{i:04d}-{f.name}.txt").write_bytes(f.read_bytes())
        (root / "COMPLETE").write_text(json.dumps(manifest))
    return root, manifest


def data_overrides(root: Path) -> list:
    "The base config's data: the training files, and the validation files as its held-out split."
    return ["data.source=files", f"data.path={root / 'train'}", f"data.heldout_path={root / 'val'}"]


def quality_args(a, name: str, budget: float, root: Path):
    "The namespace benchmarks/quality.py's `contender_trainer` reads, for contender `name` at `budget`."
    q = copy.copy(a)
    q.overrides = [*data_overrides(root), "schedule.time_budget=", *a.overrides, *contender_overrides(a, name)]
    q.plan, q.budget = "steps", budget
    return q


def trainer(a, name: str, budget: float, root: Path, seed: int, steps: int, run_dir: Path):
    "A trainer for contender `name` (quality.py's: no checkpoints, record or callbacks) and its overrides."
    return quality.contender_trainer(
        quality_args(a, name, budget, root), name if name == BASELINE else "moe", seed, steps, run_dir
    )


def cost_key(name: str) -> str:
    """The contender whose step cost `name` shares: only dropout changes the work of a step (early stopping ends a run
    sooner, the memory tables' decay is one more term of an update AdamW makes anyway)."""
    if name == BASELINE:
        return BASELINE
    return "recipe+dropout" if "dropout" in contender_parts(name) else "recipe"


def calibrate(a, names: list, root: Path) -> dict:
    """Seconds per training step of each contender: the median of interleaved timed rounds in this process, one timing
    per kind of step (`cost_key`), so contenders with the same step get the same steps, not two noisy draws."""
    keys = list(dict.fromkeys(cost_key(n) for n in names))
    costs = time_steps(a, keys, root)
    return {n: costs[cost_key(n)] for n in names}


def time_steps(a, names: list, root: Path) -> dict:
    "Seconds per training step of each contender in `names`: the median of interleaved timed rounds."
    import statistics

    import torch

    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    times = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        trs = {n: trainer(a, n, 1.0, root, 0, 10**6, Path(tmp) / n)[0] for n in names}
        for tr in trs.values():
            for _ in range(a.round_steps):
                quality.fit_step(tr)
        for r in range(a.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                c0 = clock()
                for _ in range(a.round_steps):
                    quality.fit_step(trs[n])
                times[n].append((clock() - c0) / a.round_steps)
    return {n: statistics.median(ts) for n, ts in times.items()}


def batches(a, root: Path, split: str, seq_len: int, n_bytes: int, heldout: bool = True) -> list:
    "Rows of `seq_len` covering about `n_bytes` of `split` (val or test: all of it; train: its first rows)."
    from cipher_nb.config.load import load_config
    from cipher_nb.data.curriculum import build_loader

    over = [*data_overrides(root), f"data.heldout_path={root / split}", "schedule.time_budget=", *a.overrides]
    n = max(1, -(-n_bytes // (seq_len * a.eval_rows)))
    cfg = load_config(a.config, [*over, f"training.seq_len={seq_len}", f"training.batch_size={a.eval_rows}"])
    loader = build_loader(
        cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "heldout" if heldout else "train", 0, 1
    )
    return list(islice(iter(loader), n))


def run_one(a) -> dict:
    "Train one contender at one budget for one seed; its curves and its final scores."
    import torch

    torch.set_num_threads(a.threads)
    from minimal_gpt import HeldoutView

    from cipher_nb.data.codecs import build_codec
    from cipher_nb.monitor.metrics import heldout_metrics
    from cipher_nb.train.early_stop import EarlyStopping

    root, clock = Path(a.corpus), (time.process_time if a.clock == "cpu" else time.perf_counter)
    manifest = json.loads((root / "COMPLETE").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tr, over = trainer(a, a.one, a.budget, root, a.seed, a.steps, Path(tmp) / "run")
        length = quality.trained_length(a.one, tr.cfg)
        sets = {s: batches(a, root, s, length, manifest[s]["bytes"]) for s in ("val", "test")}
        sets["train"] = batches(a, root, "train", length, manifest["test"]["bytes"], heldout=False)
        lengths = torch.as_tensor(build_codec(tr.cfg.data).byte_lengths)
        scored = HeldoutView(tr.model) if a.one == BASELINE else tr.model

        def scores() -> dict:
            tr.model.eval()
            try:
                return {s: heldout_metrics(scored, b, lengths, tr.device, tr.dtype)["val/bpb"] for s, b in sets.items()}
            finally:
                tr.model.train()

        stop = EarlyStopping(a.patience) if "stop" in contender_parts(a.one) else None
        points = sorted({max(1, round(a.steps * (i + 1) / a.eval_points)) for i in range(a.eval_points)})
        used, wall0, curve, best = 0.0, time.perf_counter(), [], None
        while tr.step < a.steps:
            c0 = clock()
            quality.fit_step(tr)
            used += clock() - c0
            if tr.step not in points:
                continue
            curve.append(dict(seconds=round(tr.step * a.cost, 2), step=tr.step, **scores()))
            if stop is not None:
                stop.on_eval(tr, {"val/loss": curve[-1]["val"]})  # bpb: the loss over the same bytes, scaled
                if stop.best_step == tr.step:  # the run's best/: kept in memory here
                    best = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
                if stop.stopped_at is not None:
                    break
        if best is not None:  # what final/ holds after a run that stops early
            tr.model.load_state_dict(best)
        end = scores() if best is not None else {k: curve[-1][k] for k in sets}
        return dict(
            name=a.one,
            seed=a.seed,
            budget=a.budget,
            clock=a.clock,
            cost=a.cost,
            steps=tr.step,
            planned=a.steps,
            best_step=stop.best_step if stop else tr.step,
            used=used,
            wall=time.perf_counter() - wall0,
            test=end["test"],
            val=end["val"],
            train=end["train"],
            gap=end["test"] - end["train"],
            curve=curve,
            overrides=over,
        )


def budget_table(runs: list, names: list, budget: float) -> str:
    "One budget's table: test bpb (mean ± spread), the same-seed gap to the minimal GPT, train bpb, the gap, steps."
    import statistics

    def mean_sd(xs):
        return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    base = {r["seed"]: r["test"] for r in runs if r["name"] == BASELINE}
    vs_col = f" vs {BASELINE}, same seed |" if base else ""  # no column when the baseline did not run
    lines = [
        f"### {budget:g} s",
        "",
        f"| contender | test bpb |{vs_col} val bpb | train bpb | test - train | steps (planned) | best step |",
        "|---" * (7 + bool(base)) + "|",
    ]
    for n in names:
        rs = [r for r in runs if r["name"] == n]
        if not rs:
            continue
        m, sd = mean_sd([r["test"] for r in rs])
        d = [r["test"] - base[r["seed"]] for r in rs if r["seed"] in base and n != BASELINE]
        vs = f" {mean_sd(d)[0]:+.4f} ({sum(x < 0 for x in d)}/{len(d)} ahead) |" if d else " |"
        steps = ", ".join(f"{r['steps']} ({r['planned']})" for r in rs)
        lines.append(
            f"| {n} | {m:.4f}" + (f" ± {sd:.4f}" if len(rs) > 1 else "") + " |" + (vs if base else "") + " "
            f"{mean_sd([r['val'] for r in rs])[0]:.4f} | {mean_sd([r['train'] for r in rs])[0]:.4f} | "
            f"{mean_sd([r['gap'] for r in rs])[0]:+.4f} | {steps} | {', '.join(str(r['best_step']) for r in rs)} |"
        )
    win = min(
        (n for n in names if any(r["name"] == n for r in runs)),
        key=lambda n: mean_sd([r["test"] for r in runs if r["name"] == n])[0],
    )
    pairs = fix_verdicts([r for r in runs if r["name"] in names], names)
    if pairs:
        lines += ["", "paired by seed (test bpb, contender - reference; 95% t interval on the mean):", "", *pairs]
    return "\n".join([*lines, "", f"lowest test bpb at {budget:g} s: **{win}**"])


def fix_verdicts(runs: list, names: list) -> list:
    "Each fix against the plain recipe, the recipe against the minimal GPT: a verdict line per pair with 2+ seeds."
    from cipher_nb.eval.verdict import paired_verdict, verdict_line

    test = {(r["name"], r["seed"]): r["test"] for r in runs}
    out = []
    for a, b in [(n, "recipe") for n in names if n.startswith("recipe+")] + [("recipe", BASELINE)]:
        seeds = sorted(s for n, s in test if n == a and (b, s) in test)
        if len(seeds) > 1:  # one seed has no interval
            out.append(
                "- " + verdict_line(paired_verdict([test[a, s] for s in seeds], [test[b, s] for s in seeds], (a, b)))
            )
    return out


def plot(runs: list, names: list, budgets: list, path: Path):
    "Test bpb against clock seconds, one panel per budget, one colour per contender."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, b in zip(axes[0], budgets):
        for i, n in enumerate(names):
            for j, r in enumerate(x for x in runs if x["name"] == n and x["budget"] == b):
                xs, ys = [p["seconds"] for p in r["curve"]], [p["test"] for p in r["curve"]]
                ax.plot(xs, ys, marker="o", ms=3, color=f"C{i}", alpha=0.9 if j == 0 else 0.5, label=None if j else n)
        ax.set_title(f"budget {b:g} s")
        ax.set_xlabel("CPU seconds of training")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test bits per byte")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_steps(a, costs: dict, budgets: list):
    "Stop with a message when a budget buys a cipher_nb contender no more steps than its warmup."
    from cipher_nb.config.load import load_config

    warmup = load_config(a.config, ["schedule.time_budget=", *a.overrides]).schedule.warmup_steps
    short = [(n, b) for b in budgets for n, c in costs.items() if n != BASELINE and int(b / c) <= warmup]
    if short:
        n, b = short[0]
        sys.exit(f"{b:g} s buys {n} {int(b / costs[n])} steps, not more than schedule.warmup_steps ({warmup})")


def run_all(a, names: list, budgets: list, root: Path) -> tuple:
    "Calibrate once, then every (budget, seed, contender) run in its own process, `--jobs` at a time."
    costs = calibrate(a, names, root)
    print("ms per step: " + ", ".join(f"{n} {c * 1e3:.1f}" for n, c in costs.items()), flush=True)
    check_steps(a, costs, budgets)
    base = [sys.executable, __file__, *a.overrides, "--config", a.config, "--corpus", str(root)]
    base += ["--clock", a.clock, "--threads", str(a.threads), "--eval-points", str(a.eval_points)]
    base += ["--eval-rows", str(a.eval_rows), "--patience", str(a.patience)]
    base += ["--dropout", str(a.dropout), "--memory-wd", str(a.memory_wd)]
    env, tmp = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}, Path(tempfile.mkdtemp(prefix="overfit-"))
    jobs = [(b, s, n) for b in budgets for s in range(a.seeds) for n in names]
    running, runs = [], []
    while jobs or running:
        while jobs and len(running) < a.jobs:
            b, s, n = jobs.pop(0)
            j = tmp / f"{n}-{b:g}-{s}.json"
            cmd = [*base, "--one", n, "--budget", str(b), "--seed", str(s), "--json", str(j)]
            cmd += ["--steps", str(int(b / costs[n])), "--cost", repr(costs[n])]
            running.append((n, b, s, j, subprocess.Popen(cmd, env=env)))
        for job in list(running):
            n, b, s, j, proc = job
            if proc.poll() is None:
                continue
            running.remove(job)
            if proc.returncode != 0:
                sys.exit(f"{n} at {b:g} s, seed {s} failed (exit {proc.returncode})")
            r = json.loads(j.read_text())
            runs.append(r)
            print(f"{n:>16} {b:>5g} s seed {s}: test {r['test']:.4f}, gap {r['gap']:+.4f}, {r['steps']} steps")
        time.sleep(0.2)
    return costs, runs


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every cipher_nb contender")
    p.add_argument("--config", default=str(ROOT / "examples/configs/tiny-cpu-90s.yaml"), help="the recipe's preset")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help="comma-separated; parts combine")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated durations of training per run")
    p.add_argument("--seeds", type=at_least(1), default=1, help="seeds per contender and budget (0, 1, ...)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (step counts are fixed: sharing cores is fair)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="what a budget second is")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per contender")
    p.add_argument("--round-steps", type=int, default=4, help="training steps per timing round")
    p.add_argument("--eval-points", type=int, default=8, help="evaluations along the steps (early stopping's too)")
    p.add_argument("--eval-rows", type=int, default=32, help="rows per evaluation batch")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="training bytes cut from the stdlib")
    p.add_argument("--heldout-bytes", type=int, default=100_000, help="bytes of the validation and of the test split")
    p.add_argument("--dropout", type=float, default=0.1, help="model.dropout of the +dropout contenders")
    p.add_argument("--memory-wd", type=float, default=0.1, help="optim.memory_weight_decay of the +memwd contenders")
    p.add_argument("--patience", type=int, default=2, help="evaluations without a lower validation bpb (+stop)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "cipher-overfit"), help="where the corpus goes")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/overfit"), help="output prefix (.md, .json, .png)")
    for hidden in ("--one", "--corpus", "--json"):  # internal: one run in this process
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    for hidden, typ in (("--budget", float), ("--seed", int), ("--steps", int), ("--cost", float)):
        p.add_argument(hidden, type=typ, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        Path(a.json).write_text(json.dumps(run_one(a)))
        return
    names = [n.strip() for n in a.contenders.split(",") if n.strip()]
    for n in names:
        try:
            contender_parts(n)
        except SystemExit as e:
            p.error(str(e))  # a usage error: exit 2
    budgets = [quality.parse_budget(b) for b in a.budgets.split(",") if b.strip()]
    root, manifest = write_corpus(a)
    print(
        f"corpus {root}: " + ", ".join(f"{s} {m['bytes']:,} bytes in {m['files']} files" for s, m in manifest.items())
    )
    costs, runs = run_all(a, names, budgets, root)
    cmd = "python benchmarks/overfit.py " + " ".join(sys.argv[1:])
    tables = [budget_table([r for r in runs if r["budget"] == b], names, b) for b in budgets]
    text = "\n\n".join([f"`{cmd}`", f"corpus: {json.dumps(manifest)}", *tables])
    print("\n" + text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(
        json.dumps(dict(command=cmd, corpus=manifest, costs=costs, runs=runs), indent=1)
    )
    plot(runs, names, budgets, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.md')}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
