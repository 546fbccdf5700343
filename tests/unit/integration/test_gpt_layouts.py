"""The equivalence proof: a GPT-MoE trains the same under every parallel layout as on one rank.

The model: a Megatron-Core GPT (``tests/gpt_tiny.py``: 4 layers, hidden 16, vocabulary 64, sequences
of 8) with the plugin's MoE MLP on layers 0, 2 and 3 (8 experts). Routing is dropless top-2 without
noise or random second-expert routing, so a token's experts do not depend on which rank sees it;
``aux_loss_coeff`` is 0 because the GShard balance loss is computed per micro-batch of a data-parallel
replica (fractions and mean gate probabilities of *its* tokens; its TP ranks route it together), so it
differs from the one-rank run by design where the micro-batches differ; the router z-loss (a mean over tokens) is on instead and moves the routers.

Every run goes through ``moe_plugin.initialize`` and DeepSpeed's engine, fp32, AdamW (DeepSpeed's
``torch_adam``, weight decay) with gradient clipping (active: ``CLIP`` is below every step's
norm), ``STEPS`` steps on the same global batch per step (``B`` sequences, split over the
data-parallel replicas and ``gas`` micro-batches), all from the same full weights: the one-rank
``GPTModel``'s, loaded by name into each rank's part (``gpt_tiny.load_full``: pipeline pieces by
``pipeline_state_dict_key``, shards by ``shard_state_dict``). pp = 1 layouts train
``GPTModel(config, gpt_moe_spec(...))`` with ``engine(...)``/``backward``/``step``; pp > 1 layouts
``gpt_pipeline_module`` with ``engine.train_batch``.

The one-rank run (ZeRO-0) is first checked against plain torch (``clip_grad_norm_``,
``torch.optim.AdamW``). Each layout is then compared with it: the loss of every step (the mean over
replicas and micro-batches) and ``engine.get_global_grad_norm()`` every step, rtol 1e-5; every
parameter shard after the last step, element-wise in units of the learning rate and as a whole
update (``PARAM_TOL``, ``UPDATE_RTOL``: why there). The losses alone would not do: Adam ignores the
scale of a gradient except through clipping, and with expert gradients 2x too large (the layer's own
edp / dp factor left in place under DeepSpeed) all five losses still agree to 1e-5; the norms
(0.5 % off) catch it, the parameters just (whole updates 6e-4 off).

One spawn per world size: the 4-rank layouts run one after the other in one spawn (engine built,
trained and ``close()``d per case), the 8-rank layout in another.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist import attempts, case_results, run_distributed
from gpt_tiny import MODEL as TINY
from gpt_tiny import (global_batch, gpt_provider, micro_batches, one_rank_groups,
                      pipeline_provider, shard_full, torch_steps)
from moe_plugin.configs import MoEConfig
import ds_json

B, SEED, STEPS = 8, 7, 5
# No linear biases: the key bias's gradient is zero in exact arithmetic (softmax ignores a constant per
# query), so it is rounding noise, which Adam scales to steps of about lr whose sign depends on the
# summation order: any two layouts (or torch and DeepSpeed on one rank) would disagree there.
MODEL = {**TINY, "add_bias_linear": False}
MOE = {"num_experts": 8, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.1, "layers": [0, 2, 3]}
LR, WEIGHT_DECAY, CLIP = 0.01, 0.01, 0.5
TOL = dict(rtol=1e-5, atol=1e-6)
# Parameters after Adam: each element's step is normalised by its own gradient's size, so an element
# whose gradient is mostly cancellation (a direction the loss does not depend on, such as the key
# weights' component along what every normed input shares) carries its gradient's relative rounding
# error into a step of about LR: errors are bounded in units of LR, not of the weight. Measured on 2
# x86 cores: at most 3.9e-5 element-wise (dp4), 8.5e-5 for a tensor's whole update (a key/query/value
# weight); the update check catches systematic differences that element-wise LR units would not.
PARAM_TOL = dict(rtol=1e-5, atol=1e-2 * LR)
UPDATE_RTOL = 5e-4
# Least gap between a token's 2nd and 3rd router logit in the one-rank run: layouts round the logits
# differently (~1e-7), so a smaller gap could send a token to other experts. SEED is chosen for it.
ROUTE_MARGIN = 1e-5

# name -> world size, moe.parallel, ZeRO stage, gradient accumulation steps.
# Comments: attention grid (tp x dp x pp), expert grid (etp x ep x edp x pp).
LAYOUTS = {
    "dp4": (4, {}, 2, 2),                                               # dp 4; edp 4 (experts replicated)
    "ep2-dp2": (4, {"expert": 2}, 2, 1),                                # dp 4; ep 2 x edp 2
    "tp2-ep2-etp2": (4, {"tensor": 2, "expert": 2}, 1, 1),              # tp 2 x dp 2; etp 2 x ep 2
    "tp2-ep4-folded": (4, {"tensor": 2, "expert": 4, "expert_tensor": 1}, 1, 2),   # tp 2 x dp 2; ep 4 over TP x DP
    "pp2-ep2": (4, {"pipeline": 2, "expert": 2}, 1, 2),                 # dp 2 x pp 2; ep 2 x pp 2
    "tp2-pp2-ep2": (8, {"tensor": 2, "pipeline": 2, "expert": 2}, 1, 2),  # tp 2 x dp 2 x pp 2; etp 2 x ep 2 x pp 2
    # Sequence parallelism: norm gradients summed over TP inside backward, before ZeRO-2's hooks take
    # them and on every pipeline stage (moe_plugin.initialize installs sp_grads hooks).
    "tp2sp-ep2-zero2": (4, {"tensor": 2, "expert": 2, "sequence_parallel": True}, 2, 2),
    "tp2sp-pp2-ep2": (8, {"tensor": 2, "pipeline": 2, "expert": 2, "sequence_parallel": True}, 1, 2),
}


def ds_config(parallel: dict, stage: int, dp: int, gas: int) -> dict:
    config = ds_json.ds_config(batch=B, dp=dp, gas=gas, clip=CLIP, zero=stage, moe=MOE, parallel=parallel,
                       optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}})
    if parallel.get("sequence_parallel") and parallel.get("pipeline", 1) > 1:
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return config


# --- inside the ranks ------------------------------------------------------------------------------------
def _copy(value):
    return value.detach().clone() if torch.is_tensor(value) else value   # state dicts hold a None or two


def _train(rank: int, world_size: int, parallel: dict, stage: int, gas: int, initial: dict, final: dict) -> dict:
    """One layout: build from ``initial``, train ``STEPS`` steps; the losses, norms, parameters, and the
    shards of the one-rank run's ``final`` parameters that this rank should hold."""
    import moe_plugin

    sizes = MoEConfig.from_dict({**MOE, "parallel": parallel}).check_world_size(world_size)
    pipelined = sizes.pp > 1
    provider = (pipeline_provider(MODEL, sizes.tp, sizes.pp, seed=SEED, initial=initial) if pipelined
                else gpt_provider(MODEL, sizes.tp, seed=SEED, initial=initial))
    result = moe_plugin.initialize(ds_config(parallel, stage, sizes.dp, gas), provider)
    engine = result.engine
    try:
        c = result.groups.layout.coords(rank)
        out = {"coords": c, "losses": [], "norms": []}
        for step in range(STEPS):
            micro = micro_batches(step, B, c["dp"], sizes.dp, gas)
            if pipelined:   # the mean over micro-batches and replicas, on every rank
                out["losses"].append([engine.train_batch(iter(micro)).item()])
            else:           # this replica's micro-batches; the engine steps the optimizer at the last
                losses = []
                for (tokens, positions), labels in micro:
                    loss = engine(tokens, positions, None, labels=labels).float().mean()
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                out["losses"].append(losses)
            out["norms"].append(float(engine.get_global_grad_norm()))
        out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        expected = shard_full(engine.module, final, result.groups, pipelined=pipelined, num_layers=MODEL["num_layers"])
        start = shard_full(engine.module, initial, result.groups, pipelined=pipelined, num_layers=MODEL["num_layers"])
        out["expected"] = {n: expected[n] for n in out["params"]}
        out["initial"] = {n: start[n] for n in out["params"]}
        return out
    finally:
        result.close()


def _one_rank(rank: int, world_size: int) -> dict:
    """The reference: one rank through the engine (ZeRO-0), and the same with plain torch."""

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    built = gpt_provider(MODEL, seed=SEED)
    initial: dict = {}

    def keep_initial(moe_config, groups):
        model = built(moe_config, groups)
        initial.update({k: _copy(v) for k, v in model.state_dict().items()})
        return model

    import moe_plugin

    result = moe_plugin.initialize(ds_config({}, 0, 1, 1), keep_initial)
    margins: list = []

    def margin(router, args):   # how close top-2 routing came to choosing other experts
        top = (args[0].detach().float() @ router.weight.detach().float().t()).topk(3, dim=-1).values
        margins.append((top[:, 1] - top[:, 2]).min().item())

    try:
        engine = result.engine
        for layer in engine.module.decoder.layers:
            if layer.moe_layer_index is not None:
                layer.mlp.router.register_forward_pre_hook(margin)
        losses, norms = [], []
        for step in range(STEPS):
            tokens, positions, labels = global_batch(step, B)
            loss = engine(tokens, positions, None, labels=labels).float().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(float(engine.get_global_grad_norm()))
        final = {k: _copy(v) for k, v in engine.module.state_dict().items()}
        moe_layers = [layer.moe_layer_index for layer in engine.module.decoder.layers]
        param_names = [n for n, _ in engine.module.named_parameters()]
    finally:
        result.close()

    with one_rank_groups() as groups:
        model = gpt_provider(MODEL, seed=SEED, initial=initial)(MoEConfig.from_dict(MOE), groups)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        batches = (global_batch(step, B) for step in range(STEPS))
        torch_losses, torch_norms = torch_steps(model, optimizer, batches, CLIP)
        torch_final = {k: _copy(v) for k, v in model.state_dict().items()}
    return {"initial": initial, "losses": losses, "norms": norms, "final": final, "moe_layers": moe_layers,
            "route_margin": min(margins),
            "param_names": param_names,
            "torch": {"losses": torch_losses, "norms": torch_norms, "final": torch_final}}


def _ranks(rank: int, world_size: int, layouts: dict, initial: dict, final: dict) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))   # as the launcher
    results = {}
    attempt = attempts(results, rank)
    for name, (_, parallel, stage, gas) in layouts.items():
        attempt(name, _train, rank, world_size, parallel, stage, gas, initial, final)
    return results


# --- the parent ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_distributed(_one_rank, 1, tmp_path_factory.mktemp("one_rank"))[0]


@pytest.fixture(scope="module")
def runs(one_rank, tmp_path_factory):
    """``runs(world_size)``: every rank's results of that world size's layouts (one spawn, made once)."""
    done: dict = {}

    def get(world_size: int) -> list:
        if world_size not in done:
            layouts = {n: c for n, c in LAYOUTS.items() if c[0] == world_size}
            done[world_size] = run_distributed(_ranks, world_size, tmp_path_factory.mktemp(f"gpt{world_size}"),
                                               layouts, one_rank["initial"], one_rank["final"], timeout=600)
        return done[world_size]
    return get


def step_losses(per_rank: list[dict]) -> torch.Tensor:
    """The global loss of each step: the mean over data-parallel replicas of each replica's mean over its
    micro-batches (every replica has the same ranks and micro-batch sizes). Ranks of one replica
    (tensor, pipeline) must agree."""
    out = []
    for step in range(STEPS):
        by_replica: dict = {}
        for result in per_rank:
            mean = sum(result["losses"][step]) / len(result["losses"][step])
            by_replica.setdefault(result["coords"]["dp"], []).append(mean)
        for replica, means in by_replica.items():
            torch.testing.assert_close(torch.tensor(means), torch.tensor(means[:1] * len(means)), **TOL,
                                       msg=lambda m: f"step {step}, replica {replica}: ranks disagree: {m}")
        out.append(sum(means[0] for means in by_replica.values()) / len(by_replica))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.slow
def test_one_rank_engine_is_plain_torch_and_training_moves(one_rank):
    ref = one_rank["torch"]
    torch.testing.assert_close(torch.tensor(one_rank["losses"]), torch.tensor(ref["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(one_rank["norms"]), torch.tensor(ref["norms"]), **TOL)
    for key, value in one_rank["final"].items():   # after Adam: element errors in units of LR (PARAM_TOL)
        torch.testing.assert_close(value, ref["final"][key], **PARAM_TOL, msg=lambda m: f"{key}: {m}")
    assert one_rank["moe_layers"] == [0, None, 2, 3]
    assert one_rank["route_margin"] > ROUTE_MARGIN, one_rank["route_margin"]
    assert all(n > CLIP for n in ref["norms"]), f"clipping should be active in every step: {ref['norms']}"
    # Every tensor moved far beyond the tolerance: the comparisons below see the optimizer at work.
    moved = {k: (ref["final"][k] - one_rank["initial"][k]).abs().max().item() for k in one_rank["param_names"]}
    assert min(moved.values()) > 1e3 * TOL["atol"], moved


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_rank(name, one_rank, runs):
    per_rank = case_results(runs(LAYOUTS[name][0]), name)
    torch.testing.assert_close(step_losses(per_rank), torch.tensor(one_rank["losses"], dtype=torch.float64), **TOL,
                               msg=lambda m: f"{name} per-step losses: {m}")
    for rank, result in enumerate(per_rank):
        def close(actual, expected, what):
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{name} rank {rank} {what}: {m}")

        close(torch.tensor(result["norms"]), torch.tensor(one_rank["norms"]), "global grad norms")
        assert set(result["params"]) == set(result["expected"])
        for pname, param in result["params"].items():
            expected, update = result["expected"][pname], result["expected"][pname] - result["initial"][pname]
            torch.testing.assert_close(param, expected, **PARAM_TOL,
                                       msg=lambda m: f"{name} rank {rank} {pname} after {STEPS} steps: {m}")
            error = ((param - expected).norm() / update.norm()).item()
            assert error < UPDATE_RTOL, f"{name} rank {rank} {pname}: its update is off by {error:.2e} (relative)"
