"""``moe_plugin.initialize`` with DeepSpeed's real engine on 4 gloo ranks, against one process.

The model is embedding-free: ``tanh(Linear) -> MoELayer (residual) -> Linear`` on [S, B, H]
inputs with an MSE loss; the MoE layer is fully parallel (EP all-to-all, ETP, token split over
TP), the Linears are replicated. Each case trains ``STEPS`` SGD steps with gradient clipping
(active: ``CLIP`` is below every step's norm) under one layout and ZeRO stage, the same seed and
the same global batch as the single-process oracle: plain torch, the whole batch at once,
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.SGD``. Compared, fp32:

* each rank's loss on its micro-batch, every step (rtol 1e-5);
* every parameter's gradient after ``engine.backward`` at the boundary, before clipping
  (``deepspeed.utils.safe_get_full_grad``: the reduced gradient, also under ZeRO-1/2), with the
  expert shards mapped to their slices of the full weights. This is where the known "expert
  gradients off by the EP size" bug would show (the message prints the ratio);
* ``engine.get_global_grad_norm()`` on every rank against the single-process norm (the known
  "norm wrong with TP + EP" bug: expert shards counted once per TP rank or not at all);
* every parameter after the last step (so clipping used the right norm), rtol 1e-5, atol 1e-6.

Routing is dropless top-2 without noise, and only the z-loss is on (a mean over tokens): the
GShard balance loss and capacity are per micro-batch (of a data-parallel replica), so they
differ from one process on the whole batch by design (``tests/unit/layers/test_layers_dist.py`` checks them against the oracle's groups).
One case turns the balance loss on with ``aux_loss_scope`` global, which makes it the one
process's: it also checks that ``initialize`` starts every step's load counts afresh.
One 4-rank spawn serves all cases: the engine is rebuilt per case and its groups released.
"""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist import attempts, case_results, run_distributed
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.layers import MoELayer
import ds_json

S, B, H, FFN, E = 4, 8, 8, 8, 4        # global batch B: every layout splits it evenly
STEPS, LR, CLIP = 3, 0.5, 0.05
TOL = dict(rtol=1e-5, atol=1e-6)
MOE = {"num_experts": E, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.1}

# name -> moe.parallel. Comments: attention dp, expert edp.
LAYOUTS = {
    "dp4": {},                                              # dp 4, edp 4 (experts replicated)
    "ep2": {"expert": 2},                                   # dp 4, edp 2
    "ep4": {"expert": 4},                                   # dp 4, edp 1
    "tp2-ep2": {"tensor": 2, "expert": 2, "expert_tensor": 1},  # EP folded over TP: dp 2, edp 2
    "tp2-ep2-etp2": {"tensor": 2, "expert": 2},             # dp 2, edp 1
}
CASES = {f"{layout}/zero{stage}": dict(parallel=parallel, stage=stage, gas=1)
         for layout, parallel in LAYOUTS.items() for stage in (0, 1, 2)}
NORM_LAYOUTS = {"tp2-ep2-etp2": dict(tp=2, ep=2, etp=2), "tp2-ep2": dict(tp=2, ep=2, etp=1),
                "ep2": dict(ep=2), "tp2": dict(tp=2, etp=1)}
CASES.update({f"ep2/zero{stage}/gas2": dict(parallel=LAYOUTS["ep2"], stage=stage, gas=2) for stage in (0, 2)})
CASES["tp2-ep2/zero1/global-balance"] = dict(parallel=LAYOUTS["tp2-ep2"], stage=1, gas=1,
                                             moe={"aux_loss_coeff": 0.1, "aux_loss_scope": "global"})


# -- the model, the data, the configs (parent and children) --------------------------------------
class TinyMoE(nn.Module):
    def __init__(self, moe_config: MoEConfig, groups=None):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = MoELayer(moe_config, H, FFN, groups, seed=3, init_std=0.3)
        self.out = nn.Linear(H, H)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in (*self.inp.parameters(), *self.out.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x_SBH, y_SBH):
        h = torch.tanh(self.inp(x_SBH))
        return F.mse_loss(self.out(h + self.moe(h)[0]), y_SBH)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def ds_config(case: dict, dp: int) -> dict:
    return ds_json.ds_config(batch=B, dp=dp, gas=case["gas"], clip=CLIP, optimizer={"type": "SGD", "params": {"lr": LR}},
                     zero=case["stage"], moe={**MOE, **case.get("moe", {})}, parallel=case["parallel"],
                     zero_allow_untested_optimizer=True)


def expert_slice(name: str, full: torch.Tensor, coords: dict, ep: int, etp: int) -> torch.Tensor:
    """A rank's shard of a full expert tensor: its experts, its F columns (weight1) or rows (weight2)."""
    local, f = E // ep, FFN // etp
    w = full[coords["ep"] * local:(coords["ep"] + 1) * local]
    cols = slice(coords["etp"] * f, (coords["etp"] + 1) * f)
    return w[:, cols] if name.endswith("weight2") else w[..., cols]


# -- children ------------------------------------------------------------------------------------
def _train(rank: int, case: dict) -> dict:
    import moe_plugin
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from moe_plugin.compat.deepspeed_zero import is_zero_optimizer, master_is_weights

    dp = MoEConfig.from_dict({**MOE, "parallel": case["parallel"]}).check_world_size(4).dp
    result = moe_plugin.initialize(ds_config(case, dp), TinyMoE)
    engine, optimizer, _, _ = result      # unpacks like deepspeed.initialize
    try:
        assert engine is result.engine and optimizer is engine.optimizer
        c = result.groups.layout.coords(rank)
        gas, micro = case["gas"], B // (dp * case["gas"])
        out = {"losses": [], "grads": [], "norms": [], "coords": c}
        for step in range(STEPS):
            x, y = batch(step)
            for m in range(gas):   # the engine steps the optimizer at the last micro-batch
                cols = slice((c["dp"] * gas + m) * micro, (c["dp"] * gas + m + 1) * micro)
                loss = engine(x[:, cols], y[:, cols])
                engine.backward(loss)
                out["losses"].append(loss.item())
                if step == 0 and m == gas - 1:   # reduced, not yet clipped (collective under ZeRO-1/2)
                    out["grads"] = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
                engine.step()
            out["norms"].append(float(engine.get_global_grad_norm()))
        out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if is_zero_optimizer(optimizer):   # fp32: DeepSpeed's masters are the weights, read through its links
            out["masters_are_weights"] = [master_is_weights(optimizer, i)
                                          for i in range(len(optimizer.single_partition_of_fp32_groups))]
            out["masters"] = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        return out
    finally:
        result.close()


def _bad_inputs(rank: int) -> dict:
    """Configs that must fail on every rank before any group or model exists."""
    import moe_plugin
    from deepspeed.utils import groups as ds_groups
    from megatron.core import parallel_state

    def provider(moe_config, groups):
        raise AssertionError("the model provider must not run")

    out = {}
    base = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    for name, cfg in {"layout": {**base, "moe": {"num_experts": 6, "parallel": {"expert": 3}}},
                      "zero3": {**base, "zero_optimization": {"stage": 3}, "moe": {"num_experts": 4}},
                      "no-moe": base}.items():
        with pytest.raises(ConfigError) as failure:
            moe_plugin.initialize(cfg, provider)
        out[name] = str(failure.value)
    out["registered"] = (parallel_state._TENSOR_MODEL_PARALLEL_GROUP is not None
                         or bool(ds_groups._get_expert_parallel_group_dict()))
    return out


def _synthetic_grads(coords: Optional[dict], tp: int, ep: int, etp: int) -> list[torch.Tensor]:
    """A replicated dense gradient, a TP-sharded one and an expert one (EP x ETP shards): the full
    tensors when ``coords`` is None, else this rank's pieces with the attributes that mark them."""
    gen = torch.Generator().manual_seed(7)
    dense, sharded, expert = (torch.randn(n, generator=gen) for n in (5, 6, 16))
    if coords is None:
        return [dense, sharded, expert]
    pieces = (dense, sharded.chunk(tp)[coords["tp"]], expert.chunk(ep * etp)[coords["ep"] * etp + coords["etp"]])
    params = [nn.Parameter(torch.zeros_like(g)) for g in pieces]
    for p, g in zip(params, pieces):
        p.grad = g.clone()
    params[1].tensor_model_parallel = True
    params[2].allreduce, params[2].group_name = False, "ep_size_2"
    return params


def _norm_ownership(rank: int, world_size: int) -> dict:
    """``global_grad_norm`` counts each distinct gradient once, for each kind of parameter."""
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.integration.grad_norm import global_grad_norm

    out = {}
    for name, sizes in NORM_LAYOUTS.items():
        groups = build_process_groups(RankLayout.build(world_size, **sizes))
        try:
            s = groups.layout.sizes
            params = _synthetic_grads(groups.layout.coords(rank), s.tp, s.ep, s.etp)
            out[name] = global_grad_norm(params, groups)
        finally:
            destroy_process_groups(groups)
    return out


def _cases_child(rank: int, world_size: int, cases: dict) -> dict:
    # What the deepspeed launcher sets (DeepSpeed's engine asserts LOCAL_RANK).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = {"bad-inputs": _bad_inputs(rank), "norm": _norm_ownership(rank, world_size)}
    attempt = attempts(results, rank)
    for name, case in cases.items():
        attempt(name, _train, rank, case)
    return results


# -- the single-process oracle and the checks ------------------------------------------------------
def reference(parallel: dict, gas: int, dp: int, moe: Optional[dict] = None) -> dict:
    model = TinyMoE(MoEConfig.from_dict({**MOE, **(moe or {})}))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    blocks = dp * gas
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y = batch(step)
        with torch.no_grad():   # the loss of each (replica, micro-batch) block, in block order
            out["losses"].append([model(x_b, y_b).item() for x_b, y_b in zip(x.chunk(blocks, 1), y.chunk(blocks, 1))])
        optimizer.zero_grad()
        model.moe.reset_balance_counts()    # a new step (the blocks above ran in training mode)
        model(x, y).backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_cases_child, 4, tmp_path_factory.mktemp("engine4"), CASES, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_single_process(name, results):
    case = CASES[name]
    per_rank = case_results(results, name)
    sizes = MoEConfig.from_dict({**MOE, "parallel": case["parallel"]}).check_world_size(4)
    ref = reference(case["parallel"], case["gas"], sizes.dp, case.get("moe"))
    assert all(n > CLIP for n in ref["norms"]), "clipping should be active in every step"

    for rank, result in enumerate(per_rank):
        c = result["coords"]

        def close(actual, expected, what):
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"rank {rank} {what}: {m}")

        def full_or_shard(name: str, full: torch.Tensor) -> torch.Tensor:
            return expert_slice(name, full, c, sizes.ep, sizes.etp) if name.startswith("moe.experts.") else full

        assert set(result["params"]) == set(ref["params"]), "the engine's model has other parameters"
        # Step 0 gradients (reduced, before clipping): the expert-gradient factor first, by name.
        for pname, grad in result["grads"].items():
            expected = full_or_shard(pname, ref["grads"][pname])
            if pname.startswith("moe.experts."):
                ratio = (grad.norm() / expected.norm()).item()
                assert abs(ratio - 1) < 1e-4, (f"rank {rank} {pname}: the expert gradient is {ratio:.4f} x the "
                                               f"single-process one (ep {sizes.ep}, dp {sizes.dp}, edp {sizes.edp})")
            close(grad, expected, f"{pname} gradient")
        for step in range(STEPS):
            blocks = slice(c["dp"] * case["gas"], (c["dp"] + 1) * case["gas"])
            close(torch.tensor(result["norms"][step]), torch.tensor(ref["norms"][step]), f"step {step} grad norm")
            close(torch.tensor(result["losses"][step * case["gas"]:(step + 1) * case["gas"]]),
                  torch.tensor(ref["losses"][step][blocks]), f"step {step} loss")
        for pname, param in result["params"].items():
            close(param, full_or_shard(pname, ref["params"][pname]), f"{pname} after {STEPS} steps")
        if case["stage"] > 0:   # one copy of the fp32 weights, which DeepSpeed's links still reach
            assert result["masters_are_weights"] and all(result["masters_are_weights"]), result["masters_are_weights"]
            for pname, param in result["params"].items():
                assert torch.equal(result["masters"][pname], param), pname


@pytest.mark.slow
def test_global_grad_norm_counts_each_gradient_once(results):
    expected = torch.cat(_synthetic_grads(None, 1, 1, 1)).norm()
    for rank, r in enumerate(results):
        for name, norm in r["norm"].items():
            torch.testing.assert_close(norm, expected, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.slow
def test_bad_configs_fail_on_every_rank_before_any_group(results):
    for r in results:
        bad = r["bad-inputs"]
        assert bad["layout"].startswith("moe.parallel.expert: got 3; expert x expert_tensor (3 x 1) must divide"), bad
        assert bad["zero3"].startswith("zero_optimization.stage: got 3; the MoE plugin supports ZeRO stages 0, 1"), bad
        assert bad["no-moe"].startswith("moe: missing; the DeepSpeed config has no 'moe' block"), bad
        assert not bad["registered"]


# -- single process: errors before distributed exists ----------------------------------------------
def _never(moe_config, groups):
    raise AssertionError("the model provider must not run")


@pytest.mark.parametrize("block, world_size, match", [
    (None, 4, r"^moe: missing; the DeepSpeed config has no 'moe' block \(its top-level keys: checkpoint, csv_monitor"),
    ({"num_experts": 8, "parallel": {"expert": 4}}, 6, r"^moe.parallel.expert: got 4; expert x expert_tensor "
                                                        r"\(4 x 1\) must divide the 6 ranks"),
    ({"num_experts": 8, "parallel": {"tensor": 4}}, 6, r"^moe.parallel.tensor: got 4; must divide the 6 ranks"),
])  # pipeline-specific errors: tests/unit/integration/test_pipeline.py
def test_config_errors_come_first_and_leave_no_files(tmp_path, monkeypatch, block, world_size, match):
    import moe_plugin
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))   # what the launcher sets
    cfg = {"train_batch_size": 24, "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "monitor")},
           "checkpoint": {"tag_validation": "Warn"}}
    if block is not None:
        cfg["moe"] = block
    with pytest.raises(ConfigError, match=match):
        moe_plugin.initialize(cfg, _never)
    assert not dist.is_initialized()
    assert list(tmp_path.iterdir()) == []


def test_config_file_and_world_size_errors(tmp_path, monkeypatch):
    import json

    import moe_plugin

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "moe": {"num_experts": 4, "parallel": {"expert": 2}}}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"^world_size: got 2; the job runs 4 ranks"):
        moe_plugin.initialize(path, _never, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE: got 'four'; expected a positive integer"):
        moe_plugin.initialize(str(path), _never)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"^zero_optimization.reduce_scatter: got False; must be true"):
        moe_plugin.initialize({"zero_optimization": {"stage": 1, "reduce_scatter": False}, "moe": {"num_experts": 4}},
                              _never, world_size=4)
    assert os.listdir(tmp_path) == ["ds.json"]


# -- param groups (single process) ------------------------------------------------------------------
def test_param_groups_split_dense_and_expert():
    from moe_plugin.integration.expert_params import check_optimizer_groups, moe_param_groups

    model = TinyMoE(MoEConfig.from_dict(MOE))
    experts = [model.moe.experts.weight1, model.moe.experts.weight2]
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    groups = moe_param_groups(model)
    assert [len(g["params"]) for g in groups] == [len(dense), 2]
    assert "moe" not in groups[0] and groups[1]["moe"] is True and groups[1]["name"] == "ep_size_1"
    assert all(a is b for a, b in zip(groups[1]["params"], experts))

    # Options of the user's groups are kept; a group of experts only loses its empty dense part.
    user = [{"params": dense, "weight_decay": 0.1, "name": "decay"}, {"params": experts, "lr": 0.5}]
    split = moe_param_groups(user)
    assert [(g.get("weight_decay"), g.get("lr"), g.get("moe"), g.get("name")) for g in split] == [
        (0.1, None, None, "decay"), (None, 0.5, True, "ep_size_1")]
    assert moe_param_groups(split) == split                     # already split: kept

    with pytest.raises(ValueError, match=r"param group 'ep_size_1' is marked 'moe' but holds 1 parameters"):
        moe_param_groups([{"params": [dense[0], *experts], "moe": True, "name": "ep_size_1"}])
    with pytest.raises(ValueError, match=r"optimizer param group 0 mixes expert parameters"):
        check_optimizer_groups(torch.optim.SGD(model.parameters(), lr=0.1))
    check_optimizer_groups(torch.optim.SGD(groups, lr=0.1))
