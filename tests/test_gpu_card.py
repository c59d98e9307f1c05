"The GPU bench card (`benchmarks/gpu_card.py`) at CPU-sized shapes: every row, its ratios, its limit, its refusals."

import importlib.util
import io
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from conftest import ROOT, run_cli

from cipher_nb.cli import run_command
from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import flops_per_token, param_counts
from cipher_nb.model.lm import CipherModel
from cipher_nb.model.moe import MoE

spec = importlib.util.spec_from_file_location("gpu_card", ROOT / "benchmarks/gpu_card.py")
card = importlib.util.module_from_spec(spec)
spec.loader.exec_module(card)


def card_run(*argv) -> tuple:
    "(exit code, stdout, stderr) of the card run in this process on `argv`, as its command line runs it."
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = run_command(card.main, list(argv)) or 0
        except SystemExit as e:  # a usage error
            code = e.code
    return code, out.getvalue(), err.getvalue()


def table(stdout: str, which: int = 0) -> dict:
    "Markdown table `which` of the card (0: the rows, 1: the MoE block's): first cell -> {column: cell}."
    tables, prev = [], None
    for i, x in enumerate(stdout.splitlines()):
        if x.startswith("|"):
            if prev != i - 1:  # a table starts after a line that is not one
                tables.append([])
            tables[-1].append(x)
            prev = i

    def cells(line):
        return [c.strip() for c in line.strip("|").split("|")]

    head, _, *body = map(cells, tables[which])
    return {r[head[0]]: r for r in (dict(zip(head, x)) for x in body)}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "card.md"
    r = run_cli(sys.executable, "benchmarks/gpu_card.py", "--smoke", "--out", str(out), timeout=300)
    return r, out


def test_smoke_prints_every_row_and_writes_the_same_card(smoke):
    r, out = smoke
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    assert list(rows) == [n for n, row in card.ROWS.items() if row.default], r.stdout
    assert out.read_text() in r.stdout  # --out: the card as printed
    for name in ("dense", "moe", "moe-balanced", "h100", "h100-fp8"):
        assert float(rows[name]["tok/s"].replace(",", "")) > 0, rows[name]
        assert float(rows[name]["plan GiB"]) >= 0, rows[name]  # the planner's peak beside the measured one
    assert rows["ep"]["note"].startswith(("not available in this version", "needs >1 GPU")), rows["ep"]
    assert rows["moe-balanced"]["routing"] == "balanced" and rows["moe"]["routing"] == "real"


def test_smoke_measures_the_moe_block_twice(smoke):
    block = table(smoke[0].stdout, 1)
    assert list(block) == ["smoke"], smoke[0].stdout
    assert all(float(block["smoke"][f"run {i}"].removesuffix("x")) > 0 for i in (1, 2))
    assert block["smoke"]["met"] == "-"  # no target at the smoke shape


def test_block_section_is_met_only_under_the_target_in_runs_that_agree():
    ratios = {"tiny-cpu": [1.20, 1.24], "h100 preset": [1.20, 1.40], "tiny-cpu-90s": [1.45, 1.40], "tiny": [1.0, 2.0]}
    block = table("\n".join(card.block_text(ratios, 20)))
    assert [block[n]["met"] for n in ratios] == ["yes", "no", "no", "-"]
    assert [block[n]["runs within 10%"] for n in ratios] == ["yes", "no", "yes", "no"]
    assert (block["tiny-cpu"]["run 2"], block["tiny-cpu-90s"]["target"]) == ("1.24x", "1.40")


def test_a_failed_block_section_is_a_line_in_the_card_and_exit_1(monkeypatch):
    def boom(*args, **kw):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(card, "block_ratios", boom)
    code, out, err = card_run("--smoke", "--rows", "dense")
    assert code == 1, out + err
    assert "MoE block section: FAILED: RuntimeError: no kernel" in out and table(out)["dense"]["tok/s"] != "-"


def test_moe_dense_column_is_the_ratio_of_its_own_rows(smoke):
    rows = table(smoke[0].stdout)
    dense = float(rows["dense"]["tok/s"].replace(",", ""))
    assert rows["dense"]["MoE/dense"] == "1.000"
    for name in ("moe", "moe-balanced"):
        tok_s = float(rows[name]["tok/s"].replace(",", ""))
        assert float(rows[name]["MoE/dense"]) == pytest.approx(tok_s / dense, abs=2e-3), rows[name]
    assert rows["h100"]["MoE/dense"] == "-"  # another model: no ratio


def test_the_pair_has_equal_active_flops():
    "The dense preset's FFN is its MoE twin's active width: FLOPs per token equal but for the router's."
    for smoke in (False, True):
        d, m = (card.row_config(card.ROWS[n], smoke, "cpu").model for n in ("dense", "moe"))
        fd, fm = card.card_flops_per_token(d, 2048), card.card_flops_per_token(m, 2048)
        assert fm == pytest.approx(fd, rel=0.01) and fm > fd
        assert m.moe.n_routed in range(8, 17) and (m.moe.top_k, m.moe.n_shared) == (2, 1) and d.moe.n_routed == 0
    assert 125e6 <= param_counts(load_config(card.CONFIGS / "gpu-card-dense.yaml").model)["total"] <= 350e6


def test_causal_attention_is_half_the_full_attention_term():
    m = load_config(card.CONFIGS / "gpu-card-dense.yaml").model
    full = flops_per_token(m, 2048)  # the trainer's count: full attention
    a = m.attention
    assert full - card.card_flops_per_token(m, 2048) == m.n_layers * 6 * a.n_heads * a.head_dim * 2048


def test_forced_balanced_routing_gives_every_expert_the_same_load():
    cfg = card.row_config(card.ROWS["moe"], True, "cpu").model
    moe = next(m for m in CipherModel(cfg).modules() if isinstance(m, MoE))
    x = torch.randn(2, 64, cfg.d_model)
    assert card.force_balanced(moe) == 1
    y, _, stats = moe(x)
    counts = stats["expert_counts"]
    assert (counts == 2 * 64 * cfg.moe.top_k / cfg.moe.n_routed).all(), counts
    y.sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0  # the gates still train the router


def test_limit_starts_no_row_it_cannot_finish():
    "A row's cost: the first row's constant before any ran, then the longest row so far."
    assert card.skip_reason(0, [], first_s=30, limit=450) == ""
    assert "about 30 s" in card.skip_reason(0, [], first_s=30, limit=20)
    assert card.skip_reason(380, [30, 60], first_s=30, limit=450) == ""  # 380 + 60 <= 450
    said = card.skip_reason(400, [30, 60], first_s=30, limit=450)  # 400 + 60 > 450
    assert said == "SKIPPED: 400 s spent + about 60 s for this row > --limit 450 s"
    assert "about 90 s" in card.skip_reason(380, [30, 60], first_s=30, limit=450, cost=1.5)  # an fp8 row: 1.5 x
    assert "about 45 s" in card.skip_reason(0, [], first_s=30, limit=40, cost=1.5)


def test_a_tiny_limit_skips_every_row_it_cannot_finish_and_still_prints_them():
    "A row not in the default card (wide-fp8) runs when named; every row here is skipped, in the card's order."
    code, out, err = card_run("--smoke", "--limit", "1", "--rows", "wide-fp8,moe,dense")
    assert code == 0, out + err
    rows = table(out)
    assert list(rows) == ["dense", "moe", "wide-fp8"]
    assert "about 45 s" in rows["wide-fp8"]["note"]  # an fp8 row's cost: 1.5 x a bf16 row's
    assert all(
        x["note"].startswith("SKIPPED") and "--limit 1" in x["note"] and x["tok/s"] == "-" for x in rows.values()
    )


@pytest.mark.parametrize(
    "args,says",
    [
        (["--smoke", "--rows", "dense,bogus"], "unknown row(s) bogus"),
        (["--device", "cuda"], "no CUDA GPU"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = card_run(*args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and out == "", err
