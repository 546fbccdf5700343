"""``ExpertMetrics``: expert load metrics into DeepSpeed's monitor, checked against per-rank stats.

* 2 ranks, a real DeepSpeed engine (``moe_plugin.initialize``, EP 2, ZeRO-1, 2 micro-batches per
  step) with the csv and tensorboard monitor backends writing into ``tmp_path``: every csv value
  equals the per-rank ``last_stats`` of every micro-batch summed (counts) or averaged (losses) by
  hand, and the tensorboard event file holds the same tags, steps and values; the log line is
  the one those sums give; every rank collects the same metrics.
* 4 ranks, two pipeline stages holding one MoE layer each: every rank sees both layers.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_json import ds_config

from moe_plugin.configs import MoEConfig
from moe_plugin.layers import MoELayer

S, B, H, FFN, E = 8, 4, 8, 16, 4
STEPS, GAS = 2, 2
MOE = {"num_experts": E, "router": "gshard", "second_expert_policy": "all", "capacity_factor": 1.0,
       "min_capacity": 1, "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001, "parallel": {"expert": 2}}


class TwoMoE(nn.Module):
    """x -> MoE -> MoE -> MSE; two MoE layers with their own weights."""

    def __init__(self, moe_config: MoEConfig, groups=None):
        super().__init__()
        self.first = MoELayer(moe_config, H, FFN, groups, seed=1, init_std=0.5)
        self.second = MoELayer(moe_config, H, FFN, groups, seed=2, init_std=0.5)

    def forward(self, x_SBH, y_SBH):
        h = x_SBH + self.first(x_SBH)[0]
        return F.mse_loss(h + self.second(h)[0], y_SBH)


def _stats(layer: MoELayer) -> dict:
    s = layer.last_stats
    return {"routed": s.routed_per_expert.clone(), "kept": s.kept_per_expert.clone(),
            "balance": float(s.balance_loss), "z": float(s.z_loss)}


def _train(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    import moe_plugin
    from moe_plugin.integration.monitor import ExpertMetrics

    config = ds_config(batch=B * world_size * GAS, micro=B, gas=GAS, clip=None, moe=MOE,
                       optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                       csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "moe"},
                       tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tb"})
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # as the launcher does
    result = moe_plugin.initialize(config, TwoMoE)
    engine = result.engine
    metrics = ExpertMetrics(engine.module)
    gen = torch.Generator().manual_seed(10 + rank)
    out: dict = {"per_forward": [], "collected": [], "lines": []}
    try:
        for step in range(STEPS):
            forwards = []
            for _ in range(GAS):
                loss = engine(torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen))
                forwards.append([_stats(engine.module.first), _stats(engine.module.second)])
                engine.backward(loss)
                engine.step()
            with torch.no_grad():   # eval forwards are not counted
                engine.module.eval()
                engine(torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen))
                engine.module.train()
            out["per_forward"].append(forwards)
            out["collected"].append(metrics.collect())
            metrics.write(engine, step)
            out["lines"].append(metrics.log_line())
        with pytest.raises(RuntimeError, match="ran no training forward since the last collect"):
            metrics.collect()
        metrics.close()
        return out
    finally:
        result.close()


def _read_csv(path: Path) -> list[tuple[int, float]]:
    with open(path) as f:
        rows = list(csv.reader(f))
    return [(int(step), float(value)) for step, value in rows[1:]]


@pytest.mark.slow
def test_metrics_reach_the_csv_and_tensorboard_monitors_and_the_log_line(dist_run, tmp_path):
    out_dir = tmp_path / "monitor"
    results = dist_run(_train, 2, str(out_dir))
    assert results[0]["collected"] == results[1]["collected"]   # every rank gets the same metrics
    assert results[0]["lines"] == results[1]["lines"]
    csv_dir = out_dir / "moe"
    for step in range(STEPS):
        per_layer = []
        for layer in range(2):
            forwards = [r["per_forward"][step][m][layer] for r in results for m in range(GAS)]
            routed = sum(f["routed"] for f in forwards)
            kept = sum(f["kept"] for f in forwards)
            expected = {"imbalance": float(routed.max() * E / routed.sum()),
                        "dropped_fraction": float(1 - kept.sum() / routed.sum()),
                        "aux_loss": sum(f["balance"] for f in forwards) / len(forwards),
                        "z_loss": sum(f["z"] for f in forwards) / len(forwards),
                        **{f"tokens_expert{e}": float(routed[e]) for e in range(E)}}
            per_layer.append(expected)
            got = results[0]["collected"][step][layer]
            assert got.layer == layer and got.forwards == GAS
            assert got.tokens_per_expert == routed.tolist() and got.kept_per_expert == kept.tolist()
            for name, value in expected.items():
                rows = _read_csv(csv_dir / f"MoE_layer{layer}_{name}.csv")
                assert rows[step][0] == step
                assert rows[step][1] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, layer, name)
        assert sum(r["per_forward"][step][0][0]["routed"].sum() for r in results) == S * B * 2 * 2  # top-2, 2 ranks
        worst = max(range(2), key=lambda i: per_layer[i]["imbalance"])
        routed_all = sum(float(sum(r["per_forward"][step][m][i]["routed"].sum() for r in results for m in range(GAS)))
                         for i in range(2))
        kept_all = sum(float(sum(r["per_forward"][step][m][i]["kept"].sum() for r in results for m in range(GAS)))
                       for i in range(2))
        aux = (per_layer[0]["aux_loss"] + per_layer[1]["aux_loss"]) / 2
        z = (per_layer[0]["z_loss"] + per_layer[1]["z_loss"]) / 2
        line = re.fullmatch(r"moe: imb (\d+\.\d\d) \(max L([01])\) drop (\d+\.\d)% aux (\d+\.\d{3}) z (\S+)",
                            results[0]["lines"][step])
        assert line, results[0]["lines"][step]
        assert int(line[2]) == worst
        for text, value, unit in ((line[1], per_layer[worst]["imbalance"], 0.01),
                                  (line[3], 100 * (1 - kept_all / routed_all), 0.1), (line[4], aux, 0.001)):
            assert abs(float(text) - value) <= unit / 2 + 1e-6, (text, value)
        assert float(line[5]) == pytest.approx(z, rel=5e-3)
    assert any(m.dropped_fraction > 0 for step in results[0]["collected"] for m in step)  # capacity 1.0 drops
    # the tensorboard backend got the same events (every tag the csv backend wrote a file for)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("MoE/")]
    assert len(tags) == len(list(csv_dir.glob("MoE_*.csv"))) == 2 * (4 + E), tags
    for tag in tags:
        board = [(e.step, e.value) for e in events.Scalars(tag)]
        rows = _read_csv(csv_dir / f"{tag.replace('/', '_')}.csv")
        assert [s for s, _ in board] == [s for s, _ in rows], tag
        assert [v for _, v in board] == pytest.approx([v for _, v in rows], rel=1e-6, abs=1e-9), tag


def _pipeline(rank: int, world_size: int, pp: int) -> list:
    """Stage s holds MoE layer 5 + s, except the third stage, which holds none."""
    from moe_plugin.groups import RankLayout, build_process_groups, destroy_process_groups
    from moe_plugin.integration.monitor import ExpertMetrics

    ep = world_size // pp
    groups = build_process_groups(RankLayout.build(world_size, pp=pp, ep=ep))
    try:
        config = MoEConfig.from_dict({**MOE, "parallel": {"expert": ep, "pipeline": pp}})
        stage = groups.rank_in("pp")
        if stage == 2:
            metrics = ExpertMetrics(nn.Linear(H, H), groups=groups)
        else:
            layer = MoELayer(config, H, FFN, groups, seed=stage).train()
            layer.layer_index = 5 + stage            # the global index a GPT spec would give it
            metrics = ExpertMetrics(nn.Sequential(layer))
            layer(torch.randn(S, B, H))
        return [(m.layer, sum(m.tokens_per_expert)) for m in metrics.collect()]
    finally:
        destroy_process_groups(groups)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_every_rank_sees_the_layers_of_every_pipeline_stage(dist_run, pp):
    routes = S * B * 2 * (4 // pp)  # top-2 routes of the stage's data-parallel ranks
    expected = [(5 + s, routes) for s in range(pp) if s != 2]
    assert dist_run(_pipeline, 4, pp) == [expected] * 4


def test_training_forwards_count_once_under_reentrant_checkpointing():
    from torch.utils.checkpoint import checkpoint

    from moe_plugin.integration.monitor import ExpertMetrics

    layer = MoELayer(MoEConfig.from_dict({**MOE, "parallel": {}}), H, FFN, seed=1).train()
    metrics = ExpertMetrics(layer)
    x = torch.randn(S, B, H, requires_grad=True)
    with torch.no_grad():
        layer(x)                                   # no gradients: not a training forward
    layer.eval()
    layer(x)                                       # eval mode: not counted
    layer.train()
    checkpoint(lambda t: layer(t)[0], x, use_reentrant=True).sum().backward()   # forward + recompute: once
    layer(x)[0].sum().backward()
    (got,) = metrics.collect()
    assert got.forwards == 2 and sum(got.tokens_per_expert) == 2 * S * B * 2


def test_a_model_without_moe_layers_is_refused():
    from moe_plugin.integration.monitor import ExpertMetrics

    with pytest.raises(ValueError, match="Linear has no MoELayer"):
        ExpertMetrics(nn.Linear(2, 2))
