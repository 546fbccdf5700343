"""Group-limited routing is one model under every layout: the example with ``group_topk`` gives the
one-rank run's losses at ep2 and ep4.

``moe.router_groups`` is a model constant (required with ``group_topk``; never the expert-parallel
size, which made the same JSON another model at another layout). The example
(``examples/gpt_moe/pretrain_gpt_moe.py``, its ``main`` on gloo ranks as the launcher would start it)
trains 8 steps with validation, seed 7, 8 experts in 4 groups of 2, each token's top-2 experts from
its best group (``group_topk`` 1), dropless, on 1 rank (4 micro-batches of 2 accumulated), dp2 x ep2
(2 each) and dp4 x ep4 (1 each, one group per rank): the per-step training losses and the validation
losses must equal the one-rank run's to 1e-5 relative. The limit must bind: without it the one-rank
losses differ. Without ``router_groups`` (and with a value the other settings never read) the
example stops before anything is written, naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist import run_distributed
from example_runs import MODEL_FLAGS, STEPS, ds_config, example_script, run_main
from ds_json import write_ds_config

MOE = {"num_experts": 8, "router": "topk", "top_k": 2, "router_groups": 4, "group_topk": 1, "drop_tokens": False,
       "aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3, "layer_interval": 1}
BATCH, MICRO = 8, 2


def _losses(tmp_path: Path, name: str, world_size: int, moe: dict) -> dict[str, list[float]]:
    path = tmp_path / f"{name}.json"
    write_ds_config(path, batch=BATCH, micro=MICRO, dp=world_size, moe=moe, parallel={"expert": world_size})
    run_dir = tmp_path / "runs" / name
    argv = [*MODEL_FLAGS, "--micro-batch-size", str(MICRO), "--deepspeed_config", str(path),
            "--run-dir", str(run_dir), "--data-cache", str(tmp_path / "data")]
    results = run_distributed(run_main, world_size, tmp_path, argv, timeout=400)
    assert [r["status"] for r in results] == [0] * world_size
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {split: [r["loss"] for r in records if r["split"] == split] for split in ("train", "valid")}
    assert len(losses["train"]) == STEPS and losses["valid"], losses
    return losses


@pytest.mark.slow
def test_group_limited_routing_gives_the_one_rank_losses_at_ep2_and_ep4(tmp_path):
    one = _losses(tmp_path, "one", 1, MOE)
    unlimited = _losses(tmp_path, "unlimited", 1, {k: v for k, v in MOE.items()
                                                  if k not in ("router_groups", "group_topk")})
    assert unlimited["train"][1:] != pytest.approx(one["train"][1:], rel=1e-4), "the group limit did not bind"
    for ep in (2, 4):
        got = _losses(tmp_path, f"ep{ep}", ep, MOE)
        for split in ("train", "valid"):
            assert got[split] == pytest.approx(one[split], rel=1e-5), (ep, split, got[split], one[split])


@pytest.mark.parametrize("moe, message", [
    ({"group_topk": 1}, r"^error: moe.router_groups: missing; group_topk \(1\) needs router_groups"),
    ({"router": "gshard", "top_k": None, "normalize_gates": False},
     r"^error: moe.normalize_gates: got False; router 'gshard' always renormalises"),
    ({"drop_tokens": False}, r"^error: moe.capacity_factor: got 1.5; drop_tokens is false"),
])
def test_a_group_limit_without_groups_or_an_unread_value_stops_the_example(tmp_path, monkeypatch, capsys, moe,
                                                                         message):
    import re

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = json.loads(ds_config(tmp_path / "ds.json", 2, expert=2).read_text())
    config["moe"] = {k: v for k, v in {**config["moe"], **moe}.items() if v is not None}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    status = example_script().main([*MODEL_FLAGS, "--deepspeed_config", "ds.json"])
    err = capsys.readouterr().err
    assert status == 2 and re.search(message, err, re.MULTILINE), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]   # no runs/, no data/
