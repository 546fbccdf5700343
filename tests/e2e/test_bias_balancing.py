"""Aux-loss-free balancing (``moe.bias_update_rate``) through the example, as a user runs it.

``router: topk``, ``aux_loss_coeff: 0``, routers skewed by ``--router-skew`` (the skew is written
into ``expert_bias``, expert 0 hottest). Nothing in the tests calls ``update_expert_bias``:
``moe_plugin.initialize``'s step boundary (``integration/step_boundary.py``) must apply it.

* 2 ranks, ep2 (``main``, ``metrics.jsonl``): with the rate > 0 the bias leaves the skew offsets
  by the rate per step and the per-expert load evens out well below the rate-0 run's imbalance;
  with rate 0 the bias stays at the offsets. The losses differ.
* pp2 x dp2 (ep2) on 4 ranks against 1 rank, through the example's own step functions on the
  ``PipelineEngine``: the bias of every layer moves, is the same on every rank holding the layer
  (each data-parallel peer routes other tokens), and follows the 1-rank run's trajectory, as do
  the losses; a validation between steps applies the boundary but adds no load.
* the boundary's rules on one layer with a stand-in step counter: once per step from all
  micro-batches, evaluation adds no load, a skipped fp16 step updates, ``apply`` (``end_step``)
  is idempotent.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from example_runs import MODEL_FLAGS, example_script
from ds_json import write_ds_config

SKEW = "2.0"
RATE = 0.05
STEPS = 16
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "layer_interval": 1}


def _ds_config(path: Path, world_size: int, rate: float, gas: int, **parallel) -> str:
    """Global batch 8 = micro-batch x ``gas`` accumulation steps x the data-parallel size."""
    dp = world_size // parallel.get("pipeline", 1)
    return write_ds_config(path, batch=8, dp=dp, gas=gas, moe={**MOE, "bias_update_rate": rate}, parallel=parallel)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One corpus for the module's runs (building it takes a while)."""
    return tmp_path_factory.mktemp("data")


def _argv(tmp_path: Path, data: Path, name: str, config: str) -> list[str]:
    return [*MODEL_FLAGS, "--train-iters", str(STEPS), "--log-interval", "4", "--eval-interval", "0",
            "--router-skew", SKEW, "--deepspeed_config", config, "--run-dir", str(tmp_path / "runs" / name),
            "--data-cache", str(data)]


def _mains(rank: int, world_size: int, argvs: list) -> list:
    """The example's ``main`` once per argv, one after the other in the same ranks."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    script = example_script()
    return [script.main(argv) for argv in argvs]


def _records(tmp_path: Path, name: str) -> list[dict]:
    lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.slow
def test_bias_evens_the_load_through_the_example_on_two_ranks(tmp_path, data_cache):
    runs = {name: _argv(tmp_path, data_cache, name, _ds_config(tmp_path / f"{name}.json", 2, rate, 1, expert=2))
            for name, rate in (("rate", RATE), ("off", 0.0))}
    assert run_distributed(_mains, 2, tmp_path, list(runs.values()), timeout=300) == [[0, 0]] * 2
    rate, off = _records(tmp_path, "rate"), _records(tmp_path, "off")
    assert [r["loss"] for r in rate] != [r["loss"] for r in off]     # the bias changes the model's function
    off_reports = [r for r in off if "moe_layers" in r]
    skews = [layer["expert_bias"] for layer in off_reports[0]["moe_layers"]]   # per layer (its logits' spread)
    for skew in skews:                                               # expert 0 hottest
        assert skew[0] == 0.0 and skew == sorted(skew, reverse=True) and skew[-1] < -0.2, skew
    for report in off_reports:                                       # rate 0: the offsets stay
        assert [layer["expert_bias"] for layer in report["moe_layers"]] == skews
    for report in (r for r in rate if "moe_layers" in r):
        step = report["step"]
        for layer, skew in zip(report["moe_layers"], skews):
            # the bias the step's forwards chose with: moved by +-RATE (or 0: load at the mean)
            # at each of the step - 1 boundaries before them
            moved = [b - s for b, s in zip(layer["expert_bias"], skew)]
            assert all(abs(m) <= RATE * (step - 1) + 1e-6 for m in moved), (step, moved)
            assert all(abs(m / RATE - round(m / RATE)) < 1e-4 for m in moved), (step, moved)
            assert any(moved), (step, moved)
    for layer, skew in zip(next(r for r in rate if "moe_layers" in r)["moe_layers"], skews):
        moved = [b - s for b, s in zip(layer["expert_bias"], skew)]
        assert moved[0] < 0 < moved[-1], moved                       # at first: the hot expert down, the cold up
    imb_rate, imb_off = ([r["imbalance"] for r in run if "moe_layers" in r] for run in (rate, off))
    # The load without the bias collapses onto two experts (2.0: every token's top-2 the same two);
    # with it, the last eight steps' load stays well below that.
    assert max(imb_rate[-2:]) < min(imb_off[-2:]) - 0.3 and imb_off[-1] > 1.9, (imb_rate, imb_off)
    print(f"imbalance every 4 steps: rate {RATE}: {imb_rate}; rate 0: {imb_off}")


# -- the PipelineEngine: 1 rank vs pp2 x dp2 -------------------------------------------------------
def _pipeline_steps(rank: int, world_size: int, argv: list, steps: int) -> dict:
    """The example's setup and step functions (``main`` without its log): the losses, and this
    rank's bias of each MoE layer it holds before every step and after the last (read after a
    validation, whose forward applies the last step's boundary)."""
    from moe_plugin import MoELayer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    script = example_script()
    args = script.parse_args(argv)
    plan = script.check_run(args, world_size)
    data = script.build_data(args, plan)
    script.configure_threads()
    result = script.build_engine(args, plan, data)
    step_fn, eval_fn = ((script.pipeline_train_step, script.pipeline_evaluate) if plan.sizes.pp > 1
                        else (script.train_step, script.evaluate))
    layers = {m.layer_index: m for m in result.engine.module.modules() if isinstance(m, MoELayer)}
    out = {"losses": [], "bias": {i: [] for i in layers}}
    try:
        for step in range(steps):
            for i, layer in layers.items():
                out["bias"][i].append(layer.router.expert_bias.tolist())
            out["losses"].append(step_fn(result, data, plan, step))
        pending = {i: layer.router.load_E.sum().item() for i, layer in layers.items()}
        out["valid"] = eval_fn(result, data, plan, 1)
        for i, layer in layers.items():
            out["bias"][i].append(layer.router.expert_bias.tolist())
            assert layer.router.load_E.sum().item() == 0 < pending[i], "the validation applied the step's load"
    finally:
        result.close()
    return out


@pytest.mark.slow
def test_pipeline_bias_is_the_same_on_every_rank_and_layout(tmp_path, data_cache):
    one = _argv(tmp_path, data_cache, "one", _ds_config(tmp_path / "one.json", 1, RATE, 2))
    [single] = run_distributed(_pipeline_steps, 1, tmp_path, one, 4, timeout=300)
    pipe_config = _ds_config(tmp_path / "pipe.json", 4, RATE, 1, pipeline=2, expert=2)
    pipe = _argv(tmp_path, data_cache, "pipe", pipe_config)
    ranks = run_distributed(_pipeline_steps, 4, tmp_path, pipe, 4, timeout=300)
    assert sorted(single["bias"]) == [0, 1]
    for index, trajectory in single["bias"].items():
        assert trajectory[-1] != trajectory[0]                       # the bias moved
        holders = [r["bias"][index] for r in ranks if index in r["bias"]]
        assert len(holders) == 2                                     # the stage's two data-parallel ranks
        assert holders[0] == holders[1]                              # bit for bit
        assert torch.tensor(holders[0]) == pytest.approx(torch.tensor(trajectory), abs=1e-6)
    for r in ranks:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert r["valid"] == pytest.approx(single["valid"], rel=1e-5)


# -- the boundary's rules, one process, a stand-in engine (only its step counter) -----------------
def test_boundary_once_per_step_from_training_forwards_only():
    """Two micro-batches per step update the bias once, from both; an evaluation forward adds no
    load and applies a pending step; a step fp16 skipped (DeepSpeed counts ``global_steps`` up all
    the same) updates it; ``apply`` twice changes nothing; ``restart`` makes the next forward a step."""
    from types import SimpleNamespace

    from moe_plugin.configs import MoEConfig
    from moe_plugin.integration.step_boundary import StepBoundary
    from moe_plugin.layers import MoELayer

    config = MoEConfig.from_dict({"num_experts": 4, "router": "topk", "top_k": 1, "drop_tokens": False,
                                  "aux_loss_coeff": 0.0, "bias_update_rate": RATE})
    layer = MoELayer(config, 8, 16, init_std=0.3)
    model = torch.nn.Sequential(layer)
    engine = SimpleNamespace(global_steps=0)
    boundary = StepBoundary(engine, model)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))

    def forward(train: bool = True):
        model.train(train)
        with torch.no_grad():
            model(x)
        return layer.router.load_E.clone(), layer.router.expert_bias.clone()

    forward(), forward()                       # step 1: two micro-batches
    step_load, bias = forward(False)           # evaluation, same step: nothing applied, nothing added
    assert step_load.sum() == 2 * x.shape[0] * x.shape[1] and not bias.any()
    engine.global_steps = 1                    # engine.step()
    load, bias = forward(False)                # the evaluation after the step applies it
    assert not load.any() and torch.equal(bias, RATE * torch.sign(step_load.mean() - step_load)) and bias.any()
    forward()
    engine.global_steps = 2                    # a skipped fp16 step still counts
    _, moved = forward()
    assert not torch.equal(moved, bias)
    boundary.apply()                           # end_step(): applies the pending forward's load
    after = layer.router.expert_bias.clone()
    boundary.apply()
    assert torch.equal(layer.router.expert_bias, after)   # nothing pending: no change
    layer.router.load_E.fill_(1.0)
    boundary.restart()
    forward(False)
    assert not layer.router.load_E.any()       # the restarted boundary applied the pending load
    boundary.remove()
    forward()
    assert layer.router.load_E.any()           # no hook any more: the load stays pending

