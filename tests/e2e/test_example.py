"""examples/gpt_moe/pretrain_gpt_moe.py: a few training steps on 1 and 2 gloo ranks, and the
mistakes that must stop it before anything is written.

* 2 ranks (dp 2, ep 2): the losses are finite and fall, ``metrics.jsonl`` (train and
  validation records, MoE statistics) and the plot exist;
* the same model, seed and global batch on 1 rank (gradient accumulation 2 instead of data
  parallelism 2): the same per-step losses (rtol 1e-5). The router is deterministic top-2 and
  each rank's micro-batch is one of the 1-rank run's micro-batches, so capacity and balance
  loss (per micro-batch) agree too;
* stopped after 4 steps with ``--save`` and resumed with ``--load``: the same losses again; the
  same checkpoint resumed on 2 ranks with EP 2 and ``--no-load-optim``: step 5's loss again;
* a micro-batch flag that disagrees with the JSON and a JSON without "moe" exit with status 2
  and one line naming the key, and leave no run directory and no data cache.

The ranks run the script's ``main`` through the project's spawn helper (what the ``deepspeed``
launcher would do: RANK, LOCAL_RANK, WORLD_SIZE set; torch.distributed initialised with gloo), by
way of ``tests/example_runs.py``.
"""
from __future__ import annotations

import json
import math

import pytest

from example_runs import MODEL_FLAGS, MOE, STEPS, ds_config, example_script, train


@pytest.mark.slow
def test_two_ranks_train_and_match_one_rank(tmp_path):
    two = train(tmp_path, "dp2_ep2", 2, "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                expert=2)
    parts = json.loads((tmp_path / "runs" / "dp2_ep2" / "parts.json").read_text())   # --profile
    assert parts["steps"] == [2, 4] and parts["mean"]["total"] > 0
    for part in ("attention", "moe.router", "moe.all_to_all", "moe.experts", "moe.combine", "optimizer"):
        assert 0 < parts["mean"][part] <= parts["max"][part], (part, parts)
    steps = [r for r in two if r["split"] == "train"]
    valid = [r for r in two if r["split"] == "valid"]
    losses = [r["loss"] for r in steps]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)) and [r["step"] for r in valid] == [4, 8]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert valid[-1]["loss"] < valid[0]["loss"]
    reports = [r for r in steps if "tokens_per_s" in r]
    assert [r["step"] for r in reports] == [4, 8]
    for r in reports:
        assert r["tokens_per_s"] > 0 and r["imbalance"] >= 1.0 and 0.0 <= r["dropped_fraction"] <= 1.0
        assert len(r["moe_layers"]) == 2      # layer_interval 1 on 2 layers
        assert r["moe"].startswith("moe: imb ")
        # the 4 steps since the last report: one micro-batch of 4 x 32 tokens per rank per step,
        # top-2 routes, summed over the 2 ranks
        assert sum(r["moe_layers"][0]["tokens_per_expert"]) == 4 * 2 * 4 * 32 * 2
    # the same figures reached DeepSpeed's monitor (its csv backend, enabled in the JSON)
    monitor = {p.name: p.read_text() for p in (tmp_path / "monitor" / "dp2_ep2").rglob("*.csv")}
    imbalance = [name for name in monitor if "layer0" in name and "imbalance" in name]
    assert imbalance, sorted(monitor)
    rows = [line.split(",") for line in monitor[imbalance[0]].splitlines()[1:]]
    assert [int(row[0]) for row in rows] == [4, 8]
    assert [float(row[1]) for row in rows] == pytest.approx([r["moe_layers"][0]["imbalance"] for r in reports])

    one = train(tmp_path, "single", 1)
    one_losses = [r["loss"] for r in one if r["split"] == "train"]
    assert one_losses == pytest.approx(losses, rel=1e-5), (one_losses, losses)

    # Stopped after half the steps and resumed from the checkpoint: the same losses again (the
    # batches follow from the step, the optimizer state from the checkpoint).
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "resumed", 1, "--train-iters", str(STEPS // 2), "--save", ckpt)
    resumed = train(tmp_path, "resumed", 1, "--load", ckpt)
    assert [r["step"] for r in resumed if r["split"] == "train"] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed if r["split"] == "train"] == pytest.approx(one_losses, rel=1e-5)

    # The 1-rank checkpoint into 2 ranks with expert parallelism 2 (weights only: the optimizer state
    # does not follow a layout change): training goes on at step 5, whose loss is the uninterrupted
    # run's (the same weights and batch); later steps start Adam afresh.
    relaid = train(tmp_path, "relaid", 2, "--load", ckpt, "--no-load-optim", expert=2)
    relaid_losses = [r["loss"] for r in relaid if r["split"] == "train"]
    assert [r["step"] for r in relaid if r["split"] == "train"] == list(range(STEPS // 2 + 1, STEPS + 1))
    assert relaid_losses[0] == pytest.approx(one_losses[STEPS // 2], rel=1e-5)
    assert all(math.isfinite(x) for x in relaid_losses)


@pytest.mark.parametrize("change, message", [
    ({"argv": ["--micro-batch-size", "2"]}, r"^error: --micro-batch-size: got 2; must equal the DeepSpeed JSON's "
                                            r"train_micro_batch_size_per_gpu \(4\)"),
    ({"drop": "moe"}, r"^error: moe: missing; the DeepSpeed config has no 'moe' block"),
    ({"set": {"train_batch_size": 12}}, r"^error: train_batch_size: got 12; must equal train_micro_batch_size_per_gpu"),
    ({"set": {"moe": {**MOE, "parallel": {"expert": 3}}}}, r"^error: moe.parallel.expert: got 3; must divide "
                                                           r"num_experts \(4\)"),
    ({"argv": ["--num-attention-heads", "3"]}, r"^error: --num-attention-heads: got 3; must divide --hidden-size"),
    ({"argv": ["--valid-fraction", "1.5"]}, r"^error: --valid-fraction: got 1.5; expected a fraction of the documents"),
    ({"argv": ["--profile", "--profile-step-end", "99"]}, r"^error: --profile-step-end: got 99; the profiled steps "
                                                         r"must lie in 0 <= --profile-step-start \(10\) < "),
])
def test_bad_flags_stop_before_anything_is_written(tmp_path, monkeypatch, capsys, change, message):
    import re

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = json.loads(ds_config(tmp_path / "ds.json", 2, expert=2).read_text())
    config.pop(change.get("drop", "-"), None)
    config.update(change.get("set", {}))
    (tmp_path / "ds.json").write_text(json.dumps(config))
    status = example_script().main([*MODEL_FLAGS, "--deepspeed_config", "ds.json", *change.get("argv", [])])
    err = capsys.readouterr().err
    assert status == 2 and re.search(message, err, re.MULTILINE), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]   # no runs/, no data/
