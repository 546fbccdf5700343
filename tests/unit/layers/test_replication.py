"""Shadow experts (hot-expert replication, ``layers/shadow.py``) and the controller's choice of them.

* Layer: on 4 and 2 gloo ranks, each case runs the layer of ``test_layers_dist`` twice from the
  same seed and noise, without and with shadowed experts (the hottest, one without tokens, one on
  another rank, under a shuffled placement, TP-folded EP, every expert; one bf16 case). Both
  runs are checked against the single-process oracle by ``test_layers_dist._check_case`` (outputs, input
  gradients, losses, every parameter gradient with the owner's expert rows, fp32 at 1e-5), and
  against each other: outputs and gradients at rtol 1e-5 (the expert GEMMs see other row blocks,
  so the rounding may differ; bf16 at 3e-2). The forward all-to-all sends exactly the routes to
  shadowed experts fewer.
* Training: DeepSpeed's engine (4 ranks, ep 2, ZeRO-2) with experts shadowed from step 2 on gives
  the plain run's losses and parameters.
* Controller: a skewed layer with ``replica_budget > 0`` gets its hot expert shadowed (logged in
  ``placement.jsonl``), a balanced one does not, and with ``replica_budget = 0`` nothing is ever
  shadowed; the cost model by hand; config errors.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.layers import test_layers_dist as base
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.layers import MoELayer
from moe_plugin.placement.costs import CostModel

E = base.E
SHUFFLED = base.SHUFFLED          # slot of expert e: expert 1 in slot 2, expert 6 in slot 1, ...


def _case(layouts, layout, router, shadow, *, cold=None, **kwargs):
    # the plain run in the counts layout, whose all-to-all sends exactly the kept routes (not padded)
    case = base._case(layouts, layout, router, exchange="counts", **kwargs)
    return {**case, "shadow": shadow, "cold": cold}


# "hot0": every token's first choice is expert 0; cold: that expert's bias is -1e3 (no tokens).
CASES4 = {
    "ep4/gshard-hot-cold": _case(base.LAYOUTS4, "ep4", "gshard", [0, 3, 5], cold=3, edit="hot0"),
    "ep4/topk3-dropless-placement": _case(base.LAYOUTS4, "ep4", "topk3", [1, 4, 6], drop=False,
                                          placement=SHUFFLED, **base.SWIGLU_SHARED),
    "tp2-ep2-dp2/gshard": _case(base.LAYOUTS4, "tp2-ep2-dp2", "gshard", [2, 7]),
    "tp2sp-ep4-dp2/switch-hot": _case(base.LAYOUTS4, "tp2sp-ep4-dp2", "switch", [0, 6], edit="hot0"),
    # GPT-OSS's experts: their biases copied with the weights, their gradients back to the owners
    "tp2-ep2-dp2/gpt-oss": _case(base.LAYOUTS4, "tp2-ep2-dp2", "topk3", [1, 5], drop=False, placement=SHUFFLED,
                                 edit="biases", **base.GPT_OSS),
}
CASES2 = {
    "dp2-ep2/gshard-hot-cold": _case(base.LAYOUTS2, "dp2-ep2", "gshard", [0, 3], cold=3, edit="hot0"),
    "dp2-ep2/switch-all-shadowed": _case(base.LAYOUTS2, "dp2-ep2", "switch", list(range(E)), placement=SHUFFLED),
    "dp2-ep2/gpt-oss-all-shadowed": _case(base.LAYOUTS2, "dp2-ep2", "topk3", list(range(E)), drop=False,
                                          edit="biases", **base.GPT_OSS),
    "tp2-ep2/topk3-dropless": _case(base.LAYOUTS2, "tp2-ep2", "topk3", [1, 2, 5], drop=False),
    "dp2-ep2/bf16-swiglu-recompute": _case(base.LAYOUTS2, "dp2-ep2", "gshard", [0, 4], edit="hot0", dtype="bfloat16",
                                           recompute_fc1=True, activation="swiglu"),
}


_BASE_LAYER = base._layer


def _layer_with(shadow):
    """``base._layer`` with the case's cold expert and, when ``shadow``, its shadowed experts."""

    def build(case, world_size=None, groups=None):
        layer = _BASE_LAYER(case, world_size, groups)
        if case.get("cold") is not None:
            with torch.no_grad():
                layer.router.expert_bias[case["cold"]] = -1e3
        if shadow and groups is not None:
            layer.set_shadow(case["shadow"])
        return layer
    return build


def _child(rank, world_size, cases):
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.layers import comm

    sent = []
    plain_all_to_all = comm.all_to_all

    def counting_all_to_all(x, out_splits, in_splits, group):
        sent.append(sum(in_splits))
        return plain_all_to_all(x, out_splits, in_splits, group)

    comm.all_to_all = counting_all_to_all        # this child's module only
    results = {}
    try:
        for name, case in cases.items():
            groups = build_process_groups(RankLayout.build(world_size, **case["sizes"]))
            try:
                for key, shadow in (("plain", False), ("shadow", True)):
                    base._layer = _layer_with(shadow)
                    sent.clear()
                    results[(name, key)] = base._run_case(rank, groups, case)
                    results[(name, key)]["sent"] = sent[0]       # the forward's all-to-all to the experts
            finally:
                destroy_process_groups(groups)
    finally:
        comm.all_to_all = plain_all_to_all
    return results


def _check(cases, world_size, results, monkeypatch):
    monkeypatch.setattr(base, "_layer", _layer_with(False))     # the oracle gets the cold expert too
    for name, case in cases.items():
        plain = [r[(name, "plain")] for r in results]
        shadow = [r[(name, "shadow")] for r in results]
        base._check_case(case, world_size, plain)
        base._check_case(case, world_size, shadow)
        tol = dict(rtol=1e-5, atol=1e-6) if case["dtype"] == "float32" else base.BF16_TOL
        for rank, (a, b) in enumerate(zip(plain, shadow)):
            torch.testing.assert_close(b["out"], a["out"], **tol)
            torch.testing.assert_close(b["x_grad"], a["x_grad"], **tol)
            for pname, grad in a["grads"].items():
                torch.testing.assert_close(b["grads"][pname], grad, **tol,
                                           msg=lambda m: f"{name} rank {rank} {pname}: {m}")
            local = a["stats_kept"][case["shadow"]].sum().item()   # this rank's routes to shadowed experts
            assert b["sent"] == a["sent"] - local, (name, rank, a["sent"], b["sent"], local)
        kept = sum(r["stats_kept"] for r in plain)
        if case["edit"] == "hot0":                                # the hottest expert is shadowed
            assert int(kept.argmax()) in case["shadow"]
        if case["cold"] is not None:
            assert kept[case["cold"]] == 0 and case["cold"] in case["shadow"]
        assert sum(r["sent"] for r in shadow) < sum(r["sent"] for r in plain), name
        if len(case["shadow"]) == E:
            assert all(r["sent"] == 0 for r in shadow)


@pytest.mark.slow
def test_shadowed_layer_on_4_ranks(dist_run, monkeypatch):
    _check(CASES4, 4, dist_run(_child, 4, CASES4, timeout=240), monkeypatch)


@pytest.mark.slow
def test_shadowed_layer_on_2_ranks(dist_run, monkeypatch):
    _check(CASES2, 2, dist_run(_child, 2, CASES2, timeout=120), monkeypatch)


def test_shadow_needs_expert_parallelism():
    layer = MoELayer(MoEConfig.from_dict({"num_experts": 4}), 8, 16)
    with pytest.raises(ValueError, match="shadow experts need expert parallelism"):
        layer.set_shadow([0])
    layer.set_shadow([])                                          # none: allowed anywhere
    with pytest.raises(ValueError, match=r"distinct ids in 0..3, got \[1, 1\]"):
        layer.shadow.set([1, 1])
    assert layer.shadowed_experts() == []


# --- in DeepSpeed's engine ---------------------------------------------------------------------

ENGINE_CASES = {"ep2/zero2/adamw": ("ep2", 2, "AdamW")}   # dp 4, edp 2: ZeRO-2 gradient hooks
SWITCH_AT, STEPS = 2, 4


def _engine_child(rank, world_size, cases):
    """``test_migration``'s two-MoE model trained twice; the second run shadows experts 0, 3 and 5
    of both layers from step ``SWITCH_AT`` on."""
    import os

    from tests.unit.placement import test_migration as mig
    from moe_plugin.layers import moe_layers

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out = {}
    for name, (layout, stage, opt) in cases.items():
        for shadow in (False, True):
            run = mig._engine(layout, stage, opt)
            try:
                losses = mig._train(run, range(SWITCH_AT))
                if shadow:
                    for layer in moe_layers(run.engine.module).values():
                        layer.set_shadow([0, 3, 5])
                losses += mig._train(run, range(SWITCH_AT, STEPS))
                out[(name, shadow)] = {"losses": losses, "state": mig._state(run)}
            finally:
                run.close()
    return out


@pytest.mark.slow
def test_shadowing_in_training_changes_nothing(dist_run):
    """Under ZeRO-2 (expert gradients averaged over EDP by the engine, ZeRO's partitions and
    gradient hooks), shadowing from step 2 on gives the losses and parameters of the plain run."""
    results = dist_run(_engine_child, 4, ENGINE_CASES, timeout=240)
    for rank, result in enumerate(results):
        for name in ENGINE_CASES:
            plain, shadow = result[(name, False)], result[(name, True)]
            torch.testing.assert_close(shadow["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
            for key, value in plain["state"].items():
                torch.testing.assert_close(shadow["state"][key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} rank {rank} {key}: {m}")


# --- controller -------------------------------------------------------------------------------

def test_cost_model_with_shadow_by_hand():
    """2 ranks, 2 experts on one node; expert 0 (rank 0) gets 8 routes from each rank, expert 1
    (rank 1) 1 from each. Shadowing expert 0: rank loads 16, 2 -> 8, 10 (rank 1 computes its own
    8 routes to expert 0); on the wire only rank 0's route to expert 1 is left."""
    cost = CostModel(seconds_per_route=1.0, seconds_per_byte_intra=0.01, seconds_per_byte_inter=1.0)
    T = torch.tensor([[8.0, 1.0], [8.0, 1.0]])
    plain = cost.layer_time(T, torch.tensor([0, 1]), [0, 0], bytes_per_route=10.0)
    assert (plain.compute, plain.replication) == (16.0, 0.0)
    assert plain.all_to_all == pytest.approx(8 * 10 * 0.01)
    shadowed = cost.layer_time(T, torch.tensor([0, 1]), [0, 0], 10.0, shadow=[0], expert_bytes=100.0)
    assert shadowed.compute == 10.0
    assert shadowed.all_to_all == pytest.approx(1 * 10 * 0.01)
    assert shadowed.replication == pytest.approx(2 * 100 * 2 * 0.5 * 0.01)   # fetch + reduce, ring all-reduce
    assert shadowed.total < plain.total
    across = cost.layer_time(T, torch.tensor([0, 1]), [0, 1], 10.0, shadow=[0], expert_bytes=100.0)
    assert across.replication == pytest.approx(2 * 100 * 2 * 0.5 * 1.0)     # EP group over two nodes


CTRL_E = 4


def _controller_child(rank, world_size, run_dir, variants):
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.placement.controller import PlacementController

    groups = build_process_groups(RankLayout.build(world_size, ep=2))
    out = {}
    try:
        for key, (policy, budget) in variants.items():
            # static without a budget checks nothing: the check settings would be refused as unread
            checks = {"check_interval": 2, "window": 2} if policy != "static" or budget else {}
            config = MoEConfig.from_dict({"num_experts": CTRL_E, "router": "gshard", "second_expert_policy": "all",
                                          "drop_tokens": False, "parallel": {"expert": 2},
                                          "placement": {"policy": policy, "replica_budget": budget, **checks}})
            model = torch.nn.ModuleDict({"hot": MoELayer(config, 8, 16, groups, seed=1),
                                         "even": MoELayer(config, 8, 16, groups, seed=2)}).train()
            with torch.no_grad():        # hot: every token to experts 0 and 1 (both on rank 0); even: 0 and 2
                model["hot"].router.expert_bias.copy_(torch.tensor([50.0, 50.0, 0.0, 0.0]))
                model["even"].router.expert_bias.copy_(torch.tensor([50.0, 0.0, 50.0, 0.0]))

            def migrate(new, model=model):
                for name, placement in new.items():   # a stand-in: the slots change, the weights do not
                    model[name].experts.placement.copy_(placement)

            # a route costs far more than a weight byte: shadowing pays where the load is skewed
            ctrl = PlacementController(model, config.placement, migrate, groups=groups, run_dir=f"{run_dir}/{key}",
                                       cost=CostModel(seconds_per_route=1e-3, seconds_per_byte_intra=1e-9,
                                                      migration_seconds_per_byte=1e-12))
            for step in range(6):
                x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(step * 7 + rank))
                model["even"](model["hot"](x)[0])[0].sum().backward()
                ctrl.step(step)
            ctrl.close()
            log = Path(f"{run_dir}/{key}/placement.jsonl")
            out[key] = {"shadow": {n: m.shadowed_experts() for n, m in model.items()},
                        "placement": model["hot"].placement.tolist(),
                        "checks": [d.__dict__ for d in ctrl.decisions],
                        "log": [json.loads(line) for line in log.read_text().splitlines()]}
    finally:
        destroy_process_groups(groups)
    return out


CTRL_VARIANTS = {"static-0": ("static", 0), "greedy-0": ("greedy", 0), "static-1": ("static", 1),
                 "static-2": ("static", 2), "greedy-1": ("greedy", 1)}


@pytest.mark.slow
def test_controller_shadows_hot_experts_only_with_a_budget(dist_run, tmp_path):
    results = dist_run(_controller_child, 2, str(tmp_path), CTRL_VARIANTS)
    for key in CTRL_VARIANTS:
        assert results[0][key]["shadow"] == results[1][key]["shadow"]
    r = results[0]
    # no budget: never a shadow, whether the policy checks (greedy) or not (static: no checks at all)
    assert r["static-0"]["checks"] == [] and r["static-0"]["log"] == []
    assert r["greedy-0"]["checks"] and r["greedy-0"]["placement"] != list(range(CTRL_E))   # it did switch
    for key in ("static-0", "greedy-0"):
        assert r[key]["shadow"] == {"hot": [], "even": []}
        assert all(d["shadow_now"] is None and d["shadow_new"] is None for d in r[key]["checks"])
        assert not [e for e in r[key]["log"] if e["event"] == "shadow" or "shadow_now" in e]
    for budget in (1, 2):
        v = r[f"static-{budget}"]
        assert v["shadow"]["even"] == []                      # balanced: nothing to gain
        hot = v["shadow"]["hot"]
        assert len(hot) == budget and set(hot) <= {0, 1}      # the hot experts of rank 0
        first = next(d for d in v["checks"] if d["layer"] == "hot")
        assert first["shadow_new"] == hot and first["shadow_seconds_new"] < first["shadow_seconds_now"]
        events = [e for e in v["log"] if e["event"] == "shadow"]
        assert events == [{"event": "shadow", "step": 1, "layer": "hot", "experts": hot, "previous": [],
                           "predicted_seconds_now": first["shadow_seconds_now"],
                           "predicted_seconds_new": first["shadow_seconds_new"]}]
        later = [d for d in v["checks"] if d["layer"] == "hot"][1:]
        assert later and all(d["shadow_new"] is None for d in later)   # no flip back
    # greedy splits the two hot experts over the ranks; under that placement shadowing gains nothing
    v = r["greedy-1"]
    assert v["placement"][0] // 2 != v["placement"][1] // 2 and v["shadow"] == {"hot": [], "even": []}
    assert all(d["shadow_new"] is None for d in v["checks"])


@pytest.mark.parametrize("block, path, expected", [
    ({"placement": {"replica_budget": 9}, "parallel": {"expert": 2}}, "moe.placement.replica_budget",
     r"at most num_experts \(8\)"),
    ({"placement": {"replica_budget": 1}}, "moe.placement.replica_budget", "need parallel.expert > 1"),
    ({"placement": {"replica_budget": 1}, "parallel": {"expert": 2, "tensor": 2}}, "moe.placement.replica_budget",
     "expert_tensor 1"),
    ({"placement": {"replica_budget": -1}}, "moe.placement.replica_budget", ">= 0"),
])
def test_replica_budget_errors(block, path, expected):
    with pytest.raises(ConfigError, match=expected) as failure:
        MoEConfig.from_dict({"num_experts": 8, **block})
    assert path in str(failure.value)
