"""fp16 and bf16 through ``moe_plugin.initialize`` and DeepSpeed's engine, against fp32.

The tiny Megatron-Core GPT-MoE of ``gpt_tiny.py`` with the balance loss on (``aux_loss_coeff`` 1.0,
so its gradient is a large part of every router's gradient), on 2 gloo ranks with EP 2. In fp16
the engine multiplies the loss by its loss scale in ``backward``; the balance loss's gradient,
which the MoE layer attaches at its output, must be scaled alike (``follow_loss_scale``),
else the optimizer's unscaling divides it by the loss scale and the routers stop balancing:

* the gradients after one fp16 backward, divided by the factor the engine scaled the loss by
  (ZeRO-1: the loss scale; ZeRO-0: 1 in DeepSpeed 0.19.8, see ``engine_loss_scale``), equal the
  fp32 run's to fp16 rounding (the router weights, where the balance loss acts, and every other
  parameter);
* with gradient accumulation the layers' ``aux_loss_scale`` is the loss scale / gas at every
  forward, following the dynamic scale when it changes;
* fp16 under ZeRO-1 and bf16 under ZeRO-2 train 4 steps with losses within 2% of fp32's; so do
  both on DeepSpeed's PipelineEngine (pp 2, one MoE layer per stage, 2 micro-batches), whose
  layers get the loss scale / gas too.

fp16 is skipped (with DeepSpeed's answer as the reason) where the accelerator has none: many
x86-64 CPUs lack oneDNN's fp16 kernels, and the product refuses fp16 there in one line.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist import needs_fp16, run_distributed
from gpt_tiny import MODEL, gpt_provider, micro_batches, pipeline_provider
import ds_json

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

B, SEED, STEPS = 8, 3, 4
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 1.0,
       "layers": [0, 2], "parallel": {"expert": 2}}


def _config(stage: int, gas: int = 1, precision: str = "fp32") -> dict:
    config = ds_json.ds_config(batch=B, dp=2, gas=gas, zero=stage, moe=MOE,
                               optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _ranks(rank: int, world_size: int, precision: str) -> dict:
    """fp32 and ``precision`` (fp16 or bf16) through ``initialize``: what the test compares."""
    import moe_plugin
    from moe_plugin.compat.deepspeed_engine import engine_loss_scale
    from moe_plugin.layers import MoELayer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out: dict = {}

    def build(config: dict):
        result = moe_plugin.initialize(config, gpt_provider(MODEL, 1, seed=SEED))
        return result, result.engine, [m for m in result.engine.module.modules() if isinstance(m, MoELayer)]

    def one_backward(stage: int, precision: str) -> dict:
        from deepspeed.utils import safe_get_full_grad

        result, engine, _ = build(_config(stage, precision=precision))
        try:
            (tokens, positions), labels = micro_batches(0, B, rank, 2, 1)[0]
            engine.backward(engine(tokens, positions, None, labels=labels).float().mean())
            factor = engine_loss_scale(engine)
            grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            return {"factor": factor, "grads": {n: g.float() / factor for n, g in grads.items() if g is not None}}
        finally:
            result.close()

    if precision == "fp16":
        out["fp32"] = one_backward(0, "fp32")
        out["fp16/zero0"], out["fp16/zero1"] = one_backward(0, "fp16"), one_backward(1, "fp16")
        result, engine, layers = build(_config(1, gas=2, precision="fp16"))
        try:   # the scale each forward saw, and the engine's scale then
            seen = []
            for step in range(STEPS):
                if step == 2:
                    engine.optimizer.cur_scale = 1024.0   # ZeRO's loss scaler, as after overflows
                for (tokens, positions), labels in micro_batches(step, B, rank, 2, 2):
                    loss = engine(tokens, positions, None, labels=labels).float().mean()
                    seen.append((layers[0].aux_loss_scale, engine_loss_scale(engine)))
                    engine.backward(loss)
                    engine.step()
            out["scales"] = seen
        finally:
            result.close()

    for name in ("fp32", precision):   # DeepSpeed's PipelineEngine, pp 2: one MoE layer per stage
        config = {**_config(1, gas=2, precision=name), "moe": {**MOE, "parallel": {"pipeline": 2}},
                  "train_micro_batch_size_per_gpu": B // 2}
        result = moe_plugin.initialize(config, pipeline_provider(MODEL, 1, 2, seed=SEED))
        try:
            engine = result.engine
            layers = [m for m in engine.module.modules() if isinstance(m, MoELayer)]
            losses, scales = [], []
            for step in range(STEPS):
                losses.append(float(engine.train_batch(iter(micro_batches(step, B, 0, 1, 2)))))
                scales.append((layers[0].aux_loss_scale, engine_loss_scale(engine)))
            out[f"pipe_losses_{name}"], out[f"pipe_scales_{name}"] = losses, scales
        finally:
            result.close()

    for name, stage in (("fp32", 1), (precision, 1 if precision == "fp16" else 2)):
        result, engine, _ = build(_config(stage, precision=name))
        try:
            losses = []
            for step in range(STEPS):
                (tokens, positions), labels = micro_batches(step, B, rank, 2, 1)[0]
                loss = engine(tokens, positions, None, labels=labels).float().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[f"losses_{name}"] = losses
        finally:
            result.close()
    return out


def _losses_agree(rank: int, out: dict, precision: str) -> None:
    torch.testing.assert_close(torch.tensor(out[f"losses_{precision}"]), torch.tensor(out["losses_fp32"]),
                               rtol=2e-2, atol=0, msg=lambda m: f"rank {rank} {precision} losses: {m}")
    torch.testing.assert_close(torch.tensor(out[f"pipe_losses_{precision}"]), torch.tensor(out["pipe_losses_fp32"]),
                               rtol=2e-2, atol=0, msg=lambda m: f"rank {rank} pipeline {precision} losses: {m}")
    assert all(a == 0.5 for a, _ in out["pipe_scales_fp32"]), out["pipe_scales_fp32"]


@needs_fp16
def test_fp16_against_fp32(tmp_path):
    for rank, out in enumerate(run_distributed(_ranks, 2, tmp_path, "fp16", timeout=300)):
        fp32 = out["fp32"]["grads"]
        assert any("router" in n for n in fp32) and out["fp32"]["factor"] == 1.0
        assert (out["fp16/zero0"]["factor"], out["fp16/zero1"]["factor"]) == (1.0, 4096.0)
        for case in ("fp16/zero0", "fp16/zero1"):
            fp16 = out[case]["grads"]
            assert set(fp16) == set(fp32)
            for name, grad in fp32.items():
                err = ((fp16[name] - grad).norm() / grad.norm()).item()
                assert err < 1e-2, f"rank {rank} {case} {name}: gradient / loss factor is off by {err:.1e} (relative)"
        assert [a for a, _ in out["scales"]] == [s / 2 for _, s in out["scales"]], out["scales"]
        assert {s for _, s in out["scales"]} == {4096.0, 1024.0}, out["scales"]
        _losses_agree(rank, out, "fp16")
        assert all(a == s / 2 for a, s in out["pipe_scales_fp16"]), out["pipe_scales_fp16"]
        assert {s for _, s in out["pipe_scales_fp16"]} == {4096.0}, out["pipe_scales_fp16"]


def test_bf16_against_fp32(tmp_path):
    """bf16 has no loss scale: the layers' aux_loss_scale is 1 / gas on the PipelineEngine too."""
    for rank, out in enumerate(run_distributed(_ranks, 2, tmp_path, "bf16", timeout=300)):
        _losses_agree(rank, out, "bf16")
        assert all(a == 0.5 and s == 1.0 for a, s in out["pipe_scales_bf16"]), out["pipe_scales_bf16"]
