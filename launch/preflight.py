#!/usr/bin/env python
"""Preflight: the checks to pass before an expensive job starts paying for GPUs.

    python launch/preflight.py examples/configs/h100.yaml training.persistent_dir=/mnt/persist --gpus 8 \\
        --out runs/h100-a

One line per check (PASS / FAIL / SKIP with the figure behind it), then the verdict; exit 1 when any check fails,
with the reasons, and 2 when each failure is in the input (a config, data or `--init` that cipher-train would refuse
with exit 2). Checks: the config loads; GPUs are present (count, name, memory) and the requested precision runs
on them; the run directory and the persistent checkpoint directory (`training.persistent_dir`; the cipher-training
runbook: never checkpoint only to local disk) have room for the checkpoints the run keeps; the persistent directory
takes a write that reads back identical; a `--init` source exists and fits the stage contract; the data is
reachable (one batch read through the real loader of this stage); the run's plan (`cipher-plan`, from fake tensors)
fits the node's GPU at its micro-batch. `--skip-gpu` runs the rest on a machine without a GPU (the plan then needs
`--gpu NAME`); `--skip-plan` skips the plan, whose byte-model figures are a worst case.
"""

import argparse
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

GB = 1e9


def bad_input(e: Exception) -> bool:
    "Whether `e` is an error in the config, data or checkpoint given, one that cipher-train refuses with exit 2."
    from cipher_nb.config.load import ConfigError
    from cipher_nb.data.sources import DataError
    from cipher_nb.persist.marker import CheckpointError

    return isinstance(e, (ConfigError, CheckpointError, DataError, FileNotFoundError, ValueError))


def check(name, fn):
    "Run one check: fn returns (passed, figure); an exception is a failure whose message is the figure."
    try:
        ok, fig = fn()
    except Exception as e:
        return name, False, f"{type(e).__name__}: {e}", bad_input(e)
    return name, ok, fig, False


def check_gpu(cfg, want: int):
    import torch

    from cipher_nb.optim.precision import detect_precision

    if not torch.cuda.is_available():
        return False, (
            "no CUDA GPU visible (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}): check the driver, CUDA_VISIBLE_DEVICES and the "
            "torch wheel, "
            "or pass --skip-gpu to run the other checks"
        )
    n = torch.cuda.device_count()
    names = {torch.cuda.get_device_name(i) for i in range(n)}
    mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / 2**30
    choice = detect_precision(cfg.training.precision, recipe=cfg.training.fp8_recipe)
    fig = (
        f"{n} x {', '.join(sorted(names))} ({mem:.0f} GiB each); "
        f"precision {cfg.training.precision} -> {choice.mode} ({choice.reason})"
    )
    if n < want:
        return False, fig + f"; need {want} (--gpus)"
    fell_back = cfg.training.precision not in ("auto", choice.mode)
    return not fell_back, fig + ("; the requested precision is not available here" if fell_back else "")


def check_plan(cfg, gpus: int, gpu: str):
    "The planner's peak per GPU at the run's micro-batch on `gpus` x `gpu` (the visible GPU when `gpu` is empty)."
    import torch

    from cipher_nb.train.plan import gpu_of, misfit_line, plan_run

    if not gpu and not torch.cuda.is_available():
        return None, "no GPU to plan for: name one with --gpu h100|h200|a100"
    if not gpu:
        props = torch.cuda.get_device_properties(0)
        gpu = gpu_of(props.name, props.total_memory / 2**30)
        if gpu is None:
            return None, f"the planner does not know {props.name}: plan one it knows with --gpu h100|h200|a100"
    p = plan_run(cfg.model, cfg.training, cfg.optim, gpus, gpu)
    fig = (
        f"{gpus} x {gpu}, {p.parallel}: peak {p.peak_gib:.1f} GiB of {p.limit_gib:.1f} at micro-batch "
        f"{p.micro_batch} (largest {p.max_micro_batch})"
    )
    return (True, fig) if p.fits else (False, misfit_line(p, cfg.training))


def checkpoint_gb(cfg) -> float:
    "Size of one training checkpoint: fp32 weights and AdamW's two moments (8-bit AdamW: two bytes of moments)."
    from cipher_nb.config.sizing import param_counts

    n = param_counts(cfg.model)["total"]
    return n * (4 + (2 if cfg.optim.name == "adamw8bit" else 8)) / GB


def need_gb(cfg, min_gb: float) -> float:
    "Room for keep_last step checkpoints, best/, one being written, and the export; at least --min-disk-gb."
    return max(min_gb, checkpoint_gb(cfg) * (cfg.training.keep_last + 2) + checkpoint_gb(cfg) / 3)


def _existing(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def check_disk(path: Path, cfg, min_gb: float):
    free = shutil.disk_usage(_existing(path)).free / GB
    need = need_gb(cfg, min_gb)
    return (
        free >= need,
        f"{free:,.1f} GB free at {_existing(path)}, need {need:,.1f} GB "
        f"({cfg.training.keep_last} kept + best + one in flight, {checkpoint_gb(cfg):.2f} GB each)",
    )


def check_writable(path: Path, size_mb: int = 8):
    "Create the folder, write a file, fsync, read it back identical, delete it."
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".preflight-{uuid.uuid4().hex}"
    data = os.urandom(size_mb << 20)
    t0 = time.perf_counter()
    try:
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        secs = time.perf_counter() - t0
        same = probe.read_bytes() == data
    finally:
        probe.unlink(missing_ok=True)
    return same, f"wrote and read back {size_mb} MB at {size_mb / max(secs, 1e-9):,.0f} MB/s" + (
        "" if same else ": READ BACK DIFFERENT"
    )


def check_persistent(cfg, out: Path, allow_local: bool):
    p = cfg.training.persistent_dir
    if not p:
        if allow_local:
            return None, "training.persistent_dir is empty: checkpoints stay on local disk (--allow-local)"
        return False, (
            "training.persistent_dir is empty: checkpoints would live only on this machine's disk and die with it "
            "(the cipher-training runbook: never checkpoint only to local disk). "
            "Set training.persistent_dir=/path/on/a/persistent/volume"
        )
    ok, fig = check_writable(Path(p))
    same_dev = os.stat(_existing(out)).st_dev == os.stat(p).st_dev
    return ok, f"{p}: {fig}" + (
        "; note: same filesystem as the run directory, is it really a persistent volume?" if same_dev else ""
    )


def check_init(cfg):
    if not cfg.stage.init:
        return None, "no --init (training from scratch)"
    from cipher_nb.data.sources import data_fingerprint  # refinement must read exactly its source's data
    from cipher_nb.persist.stages import check_init_source

    meta = check_init_source(cfg.stage.init, cfg.stage, cfg.data, data_fingerprint(cfg.data), cfg.sft.lora_rank)
    return True, f"{cfg.stage.init}: stage {meta.get('stage')} step {meta.get('step')} -> {cfg.stage.name}"


def check_data(cfg, timeout: float):
    "One training batch through this stage's real loader, within `timeout` seconds."
    from cipher_nb.train.builder import stage_hooks

    res = {}

    def read():
        try:
            hooks = stage_hooks(cfg.stage.name)
            c = hooks.config(cfg)
            loader, _ = hooks.data(0, 1)
            b = next(iter(loader))
            res["fig"] = f"{c.data.source} {c.data.path or ''}".strip() + f": one batch {tuple(b['input_ids'].shape)}"
        except BaseException as e:
            res["err"] = e

    t = threading.Thread(target=read, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(timeout)
    if t.is_alive():
        return (
            False,
            f"no batch within {timeout:g} s from data.source={cfg.data.source} {cfg.data.path}: "
            "network, credentials or the path?",
        )
    if "err" in res:
        raise res["err"]
    return True, res["fig"] + f" in {time.perf_counter() - t0:.1f} s"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", help="a YAML preset (default: the built-in tiny-cpu config)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, as given to cipher-train")
    ap.add_argument(
        "--gpus", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), help="GPUs this node must have"
    )
    ap.add_argument("--skip-gpu", action="store_true", help="skip the GPU check (run the others on a CPU machine)")
    ap.add_argument("--gpu", default="", help="plan for this GPU (h100, h200, a100; default: the visible one)")
    ap.add_argument("--skip-plan", action="store_true", help="skip the memory plan (cipher-plan)")
    ap.add_argument("--out", default=None, help="the run directory cipher-train will write (default: training.out_dir)")
    ap.add_argument("--min-disk-gb", type=float, default=0.0, help="free space to demand at least, in GB")
    ap.add_argument("--allow-local", action="store_true", help="accept an empty training.persistent_dir")
    ap.add_argument("--data-timeout", type=float, default=120.0, help="seconds to wait for the first batch")
    a = ap.parse_args(argv)
    if a.config and "=" in a.config and not a.config.endswith((".yaml", ".yml")):
        a.config, a.overrides = None, [a.config, *a.overrides]

    from cipher_nb.config.load import load_config

    results = [check("config", lambda: (True, f"{a.config or 'defaults'} with {len(a.overrides)} override(s)"))]
    try:
        cfg = load_config(a.config, a.overrides)
    except Exception as e:
        results = [("config", False, f"{type(e).__name__}: {e}", bad_input(e))]
        cfg = None
    if cfg is not None:
        out = Path(a.out or Path(cfg.training.out_dir) / (cfg.training.run_name or "run"))
        results += [
            ("gpu", None, "skipped (--skip-gpu)", False)
            if a.skip_gpu
            else check("gpu", lambda: check_gpu(cfg, a.gpus)),
            check("disk: run directory", lambda: check_disk(out, cfg, a.min_disk_gb)),
            check("run directory writable", lambda: check_writable(out, 1)),
            check("persistent checkpoint directory", lambda: check_persistent(cfg, out, a.allow_local)),
        ]
        if cfg.training.persistent_dir:
            results.append(
                check(
                    "disk: persistent directory",
                    lambda: check_disk(Path(cfg.training.persistent_dir), cfg, a.min_disk_gb),
                )
            )
        results += [
            check("init source", lambda: check_init(cfg)),
            check("data reachable", lambda: check_data(cfg, a.data_timeout)),
        ]
        if a.skip_plan or (a.skip_gpu and not a.gpu):
            results.append(("plan", None, "skipped (--skip-plan, or --skip-gpu without --gpu)", False))
        else:
            results.append(check("plan", lambda: check_plan(cfg, a.gpus, a.gpu)))
    w = max(len(n) for n, *_ in results)
    for n, ok, fig, _ in results:
        print(f"{ {True: 'PASS', False: 'FAIL', None: 'SKIP'}[ok] }  {n:<{w}}  {fig}")
    failed = [(n, bad) for n, ok, _, bad in results if ok is False]
    print(f"preflight {'FAIL: ' + ', '.join(n for n, _ in failed) if failed else 'PASS'}")
    # the exit-code contract: 2 when every failure is in what was given (fix the input), 1 when one is not
    return (2 if all(bad for _, bad in failed) else 1) if failed else 0


if __name__ == "__main__":
    sys.exit(main())
