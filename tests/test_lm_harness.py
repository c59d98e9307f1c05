"""lm-evaluation-harness on a trained cipher model, offline: `cipher-eval --harness` over a task defined on a local
file gives the project's own multiple-choice accuracy and log-likelihoods, by name and from a path; without the
harness installed, or for a task it does not know, `--harness` is refused in one line."""

import json
import sys
import warnings

import pytest
from conftest import WIDTH_32
from fastcore.script import CliError

from cipher_nb.config.load import load_config
from cipher_nb.eval.harness import cipher_eval, load_mc
from cipher_nb.train.builder import build_trainer

SMALL = [
    *WIDTH_32,
    "training.seq_len=64",
    "training.batch_size=4",
    "schedule.max_steps=30",
    "schedule.warmup_steps=3",
    "training.precision=fp32",
    "training.eval_batches=1",
    "training.log_every=1000",
    "training.eval_every=1000",
    "training.checkpoint_every=1000",
]
ITEMS = [
    ("def add(a, b):\n    return", ["a + b", "a } b", "]]"], 0),
    ("import", ["os", "42"], 0),
    ("for i in range(10):\n   ", ["print(i)", ")))"], 0),
    ("x = [1, 2,", ["3]", "3)"], 0),
    ("class Point:\n    def", ["__init__(self):", "=="], 0),
    ("# a comment", ["\n", "))"], 0),
    ("return", ["None", "{{"], 1),
    ("if x", ["== 1:", "=== 1:"], 0),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread_module):
    "A byte model trained for 30 steps, a multiple-choice file, and an lm-evaluation-harness task over that file."
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval: the dev extra)")
    from cipher_nb.eval.lm_harness import mc_task_yaml

    root = tmp_path_factory.mktemp("lm-harness")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_trainer(load_config(None, SMALL), root / "run", progress=False).fit(progress=False)
    mc = root / "python-mc.jsonl"
    mc.write_text("".join(json.dumps(dict(context=c, choices=ch, label=y)) + "\n" for c, ch, y in ITEMS))
    (root / "tasks").mkdir()
    (root / "tasks" / "python_mc.yaml").write_text(mc_task_yaml("python_mc", mc))
    return root / "run" / "final", mc, root / "tasks"


@pytest.fixture(scope="module")
def one_thread_module():
    import torch

    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def per_item(result: dict, task: str) -> list:
    "Each document's choice log-likelihoods from an lm-evaluation-harness result, in file order."
    docs = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in d["resps"]] for d in docs]


def test_the_harness_and_the_project_agree_on_a_local_file(setup):
    final, mc, tasks = setup
    res = cipher_eval(str(final), mc=str(mc), docs=0, harness="python_mc", tasks_dir=str(tasks), device="cpu")
    ours, theirs = res["mc"], res["harness"]
    assert theirs["results"]["python_mc"]["acc,none"] == ours["acc"]
    assert len(per_item(theirs, "python_mc")) == len(load_mc(mc)) == ours["n"]
    for a, b in zip(per_item(theirs, "python_mc"), [p["logprobs"] for p in ours["predictions"]]):
        assert a == pytest.approx(b, abs=1e-5)
    proto = theirs["cipher_protocol"]
    assert (proto["dtype"], proto["max_len"], proto["truncated"]) == ("float32", 2048, 0)
    assert {k: ours["protocol"][k] for k in ("dtype", "max_len")} == {k: proto[k] for k in ("dtype", "max_len")}


def test_the_harness_finds_the_model_by_name_and_path(setup):
    "lm_eval's own door: `model='cipher_nb'` with the export's path, as `lm_eval --model cipher_nb` would."
    import lm_eval
    from lm_eval.tasks import TaskManager

    final, mc, tasks = setup
    out = lm_eval.simple_evaluate(
        model="cipher_nb",
        model_args=dict(pretrained=str(final), device="cpu"),
        tasks=["python_mc"],
        num_fewshot=0,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    )
    ours = cipher_eval(str(final), mc=str(mc), docs=0, device="cpu")["mc"]
    assert out["results"]["python_mc"]["acc,none"] == ours["acc"]


def test_harness_refusals(setup, monkeypatch):
    final, _, tasks = setup
    with pytest.raises(CliError, match="cipher-eval: .*no_such_task"):
        cipher_eval(str(final), docs=0, harness="no_such_task", tasks_dir=str(tasks), device="cpu")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(CliError, match="--harness needs lm-evaluation-harness: pip install lm-eval"):
        cipher_eval(str(final), docs=0, harness="python_mc", device="cpu")
