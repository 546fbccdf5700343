"""examples/gpt_moe/scaling: the quick study end to end through the deepspeed launcher, and the GPU recipe.

* ``study.py --quick`` on three of its nine tiny models (dense, 4 experts top-2, 8 experts top-1), 2 ranks
  each (``make scaling-quick`` runs the nine on 4 ranks): every artifact is written; the losses
  are finite and fall; the parameters the runs counted on their ranks equal the formula of
  ``moe_plugin_tools/report/params.py``; the active parameters are the dense model's up to the routers
  (and the dense MLP's biases, which experts do not have); total parameters grow with the
  experts; the CSV and the JSON summary agree;
* run again, it trains nothing (every model already trained) and writes the report again;
* a bad ``--models`` value exits with status 2 naming it, before anything is written;
* ``upcycling.py --quick`` (with ``MOE_UPCYCLING_QUICK=1``): the dense model half-way, continued dense,
  upcycled (the example resumes from the upcycled checkpoint) and e8-top2 from scratch;
* the GPU recipe's configs pass ``moe-plugin check-config`` at the cluster's size and are what
  ``gpu_recipe.py`` writes now.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

from launcher import REPO, Done, free_ports, run
from moe_plugin_tools.cli import main as cli_main

SCALING = REPO / "examples" / "gpt_moe" / "scaling"
RANKS = 2
MODELS = ["dense", "e4-top2", "e8-top1"]   # of the quick family's nine: both top-k and two expert counts, 2 ranks each


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"scaling_{name}", SCALING / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _study(out: Path, data: Path, *extra: str) -> Done:
    return run([sys.executable, str(SCALING / "study.py"), "--quick", "--out", str(out), "--data-cache", str(data),
                "--master-port", str(free_ports(1)[0]), "--ranks", str(RANKS), "--models", ",".join(MODELS), *extra],
               timeout=1200, split_stderr=True)


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    out, data = root / "study", root / "data"
    done = _study(out, data)
    assert done.status == 0, done.tail()
    return out, data, done.output


@pytest.mark.slow
def test_quick_study_writes_every_artifact(quick_study):
    out, _data, stdout = quick_study
    for name in ["report.md", "summary.csv", "summary.json", "study.json", "loss.png", "loss_vs_flops.png",
                 "scaling.png", "balance.png"] + [f"expert_load_{m}.png" for m in MODELS[1:]]:
        assert (out / name).stat().st_size > 0, name
    for model in MODELS:
        assert (out / "runs" / model / "metrics.jsonl").stat().st_size > 0, model
        assert (out / "configs" / f"{model}.json").exists() and (out / "logs" / f"{model}.log").exists()
    study = json.loads((out / "study.json").read_text())
    assert study["models"] == MODELS and study["ranks"] == RANKS and study["machine"]["cpus"] >= 1
    assert set(study["wall_s_per_model_this_invocation"]) == set(MODELS)
    assert "best valid" in stdout and "report:" in stdout
    text = (out / "report.md").read_text()
    assert "![scaling.png](scaling.png)" in text and "| model | dense | 4 experts top-2 |" in text


@pytest.mark.slow
def test_quick_study_numbers_are_sane(quick_study):
    out, _data, _stdout = quick_study
    records = {r["name"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert list(records) == MODELS
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == MODELS
    for row in rows:
        record = records[row["name"]]
        assert int(row["params_total"]) == record["params_total"]
        assert float(row["best_valid_loss"]) == pytest.approx(record["best_valid_loss"])

    family = _module("family")
    sizes = family.SIZES["quick"]
    h, f = sizes.hidden_size, sizes.ffn_hidden_size
    moe_layers = len(range(0, sizes.num_layers, sizes.moe_layer_interval))
    dense = records["dense"]
    for name, r in records.items():
        train = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        losses = [x["loss"] for x in train if x["split"] == "train"]
        valid = [x["loss"] for x in train if x["split"] == "valid"]
        assert len(losses) == sizes.train_iters and all(math.isfinite(x) for x in losses + valid), name
        assert sum(losses[-4:]) / 4 < losses[0] - 1.0 and valid[-1] < valid[0], (name, losses, valid)
        # the formula equals what the ranks counted on the model, total and active
        assert r["measured_params_total"] == r["params_total"], name
        assert r["measured_params_active"] == r["params_active"], name
        assert [step for step, _ in r["valid_loss_by_step"]] == list(range(sizes.eval_interval, sizes.train_iters + 1,
                                                                           sizes.eval_interval))
        assert r["median_step_s"] > 0 and r["median_tokens_per_s"] > 0 and r["flops_per_token"] > 0
        assert len(r["peak_memory_mb_per_rank"]) == RANKS
        assert all(peak >= before > 0 for peak, before in zip(r["peak_memory_mb_per_rank"],
                                                               r["memory_before_model_mb_per_rank"]))
        if name == "dense":
            assert r["experts"] is None and r["final_imbalance"] is None and r["params_expert"] == 0
            continue
        # same compute: the top-k experts of width f/k replace the dense MLP; the routers (h x E)
        # are added and the dense MLP's biases (f + h) are not there
        assert r["params_active"] - dense["params_active"] == moe_layers * (h * r["experts"] - f - h), name
        assert r["final_imbalance"] >= 1.0 and 0.0 <= r["final_dropped_fraction"] <= 1.0
    totals = [r["params_total"] for r in records.values()]   # dense, 4 experts, 8 experts
    assert totals == sorted(totals) and len(set(totals)) == len(totals), totals


@pytest.mark.slow
def test_quick_study_resumes_without_training_again(quick_study):
    out, data, _stdout = quick_study
    before = {m: (out / "runs" / m / "metrics.jsonl").stat().st_mtime_ns for m in MODELS}
    (out / "report.md").unlink()
    again = _study(out, data)
    assert again.status == 0, again.tail()
    assert again.output.count("already trained") == len(MODELS)
    assert {m: (out / "runs" / m / "metrics.jsonl").stat().st_mtime_ns for m in MODELS} == before
    assert (out / "report.md").exists()


def test_unknown_model_stops_before_anything_is_written(tmp_path, capsys):
    study = _module("study")
    assert study.main(["--quick", "--models", "dense,e3-top2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --models: got 'e3-top2'; valid: dense, e4-top2") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_gpu_recipe_configs_check_and_are_current(tmp_path, capsys):
    recipe = _module("gpu_recipe")
    committed = sorted((SCALING / "gpu" / "configs").glob("*.json"))
    assert [p.name for p in committed] == sorted(f"{s.name}_{m}.json" for s in recipe.SIZES
                                                 for m in recipe.member_names())
    for path in committed:
        assert cli_main(["check-config", str(path), "--world-size", "64"]) == 0, path
    capsys.readouterr()
    recipe.generate(tmp_path, progress=False)
    for path in committed + [SCALING / "gpu" / "plan.md"]:
        fresh = tmp_path / path.relative_to(SCALING / "gpu")
        assert fresh.read_text() == path.read_text(), f"{path} is stale: run python {SCALING / 'gpu_recipe.py'}"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_UPCYCLING_QUICK") != "1",
                    reason="four launcher runs, ~2 minutes: set MOE_UPCYCLING_QUICK=1 (or run make upcycling-quick)")
def test_quick_upcycling_study(tmp_path):
    """``upcycling.py --quick`` on 2 ranks: the dense model half-way, then continued dense, upcycled
    (the example loads the upcycled checkpoint with its usual ``--load``), and e8-top2 from scratch;
    the upcycled model's first training loss (the same batch) is the dense continuation's up to the
    routes capacity drops; the table, plot and the checkpoint's record of its source are written."""
    out = tmp_path / "upcycling"
    done = run([sys.executable, str(SCALING / "upcycling.py"), "--quick", "--ranks", "2", "--out", str(out),
                "--data-cache", str(tmp_path / "data"), "--master-port", str(free_ports(1)[0])], timeout=900,
               split_stderr=True)
    assert done.status == 0, done.tail()
    record = json.loads((out / "upcycling.json").read_text())
    half, total = record["half"], _module("family").SIZES["quick"].train_iters
    dense, upcycled, scratch = record["rows"]
    assert [r["runs"][-1] for r in record["rows"]] == ["dense-continued", "upcycled-e8-top2", "e8-top2-scratch"]
    assert [s for s, _ in upcycled["train"]] == list(range(1, total + 1)) == [s for s, _ in scratch["train"]]
    assert dense["train"][:half] == upcycled["train"][:half] and dense["tokens"] == upcycled["tokens"] == scratch["tokens"]
    assert abs(dense["train"][half][1] - upcycled["train"][half][1]) < 0.01, (dense["train"][half], upcycled["train"][half])
    assert all(math.isfinite(r["final_valid_loss"]) for r in record["rows"])
    meta = json.loads((out / "checkpoints" / "upcycled" / f"step{half}" / "moe_plugin.json").read_text())
    assert meta["upcycled_from"]["granularity"] == 2 and meta["moe"]["gate_scale"] == 2.0
    assert (out / "upcycling.png").stat().st_size > 0 and "(b) dense, upcycled to e8-top2" in done.output
