"""Dynamic expert placement wired into examples/gpt_moe/pretrain_gpt_moe.py (2 gloo ranks, dp 2 x ep 2).

With ``moe.placement.policy: greedy`` (check every 2 steps), a strongly skewed router
(``--router-skew``: experts 0 and 1, both on EP rank 0 under the static placement, take most of
the load) and a gate trace:

* the controller switches at least once, and the switch is logged in ``placement.jsonl`` (a
  ``start`` record with the layers and their static placements, ``check`` records, a ``switch``
  record with the measured migration time) and the rank imbalance it predicts falls;
* the losses stay finite through the switches (the model function across a migration is
  ``tests/unit/placement/test_migration.py``'s business: weights and optimizer state move bit for bit);
* the gate trace exists and reads back with one record per step, every MoE layer, and the
  kept routes of each step summing to the routes the ranks processed (dropless: all of them);
* the progress line's record carries the placement summary, and each step its wall time.

Also: ``training_placement`` is None for the static policy without a trace (no hooks).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dist import run_distributed
from example_runs import MODEL_FLAGS, STEPS, run_main
from ds_json import write_ds_config

MOE = {"num_experts": 4, "router": "switch", "drop_tokens": False, "aux_loss_coeff": 0.0, "layer_interval": 1,
       "parallel": {"expert": 2},
       "placement": {"policy": "greedy", "check_interval": 2, "window": 2, "min_gain": 0.05,
                     "trace_file": "gate.trace"}}


# Tokens per step: the predicted saving of a switch grows with them, its migration cost does not; at
# 8 sequences a step the saving was within 5% of the cost and the outcome hung on the initial weights.
MICRO = 8


def _config(path, moe):
    write_ds_config(path, batch=2 * MICRO, micro=MICRO, gas=1, moe=moe)
    return path


@pytest.mark.slow
def test_greedy_placement_switches_and_traces(tmp_path):
    from moe_plugin.placement import read_trace

    run_dir = tmp_path / "runs" / "greedy"
    argv = [*MODEL_FLAGS, "--deepspeed_config", str(_config(tmp_path / "greedy.json", MOE)), "--run-dir", str(run_dir),
            "--data-cache", str(tmp_path / "data"), "--router-skew", "1.5",
            "--micro-batch-size", str(MICRO)]
    results = run_distributed(run_main, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [0, 0]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["step_s"] > 0 for r in train)
    assert all(r["placement"].startswith("placement greedy: ") for r in train if "tokens_per_s" in r)

    log = [json.loads(line) for line in (run_dir / "placement.jsonl").read_text().splitlines()]
    start = log[0]
    assert start["event"] == "start" and start["policy"] == "greedy"
    assert sorted(start["layers"].values()) == ["layer0", "layer1"]
    assert all(p == [0, 1, 2, 3] for p in start["placements"].values())
    checks = [r for r in log if r["event"] == "check"]
    assert sorted({r["step"] for r in checks}) == list(range(1, STEPS, 2))   # steps 2, 4, ... (0-based 1, 3, ...)
    switched = [r for r in checks if r["switch"]]
    assert switched, checks
    for r in switched:
        assert r["imbalance_new"] < r["imbalance_now"] and sorted(r["placement"]) == [0, 1, 2, 3]
    switches = [r for r in log if r["event"] == "switch"]
    assert switches and all(r["measured_migration_seconds"] >= 0 and r["moved_bytes"] > 0 for r in switches)

    trace = read_trace(run_dir / "gate.trace")
    assert sorted(trace.layers) == ["layer0", "layer1"] and trace.num_experts == 4 and trace.ep_size == 2
    assert trace.steps.tolist() == list(range(STEPS))
    # dropless top-1: every token of the step's global batch (8 sequences x 32 tokens) is kept once
    assert np.all(trace.kept().sum(-1) == 2 * MICRO * 32) and np.all(trace.load.sum(-1) == 2 * MICRO * 32)
    assert trace.kept()[:, :, :2].sum() > 0.7 * trace.kept().sum()       # the skew: experts 0 and 1 are hot


def test_static_policy_without_trace_builds_nothing():
    from types import SimpleNamespace

    from moe_plugin.configs import MoEConfig
    from moe_plugin.integration.placement import training_placement

    run = SimpleNamespace(engine=None, moe_config=MoEConfig.from_dict({"num_experts": 4}))
    assert training_placement(run) is None
