"""Load-adaptive expert placement: gate traces, placement policies, load tracking, switching.

* Trace: a round trip of random counts (numpy and torch inputs), a torn last record, append
  after a restart, the bytes per step the docstring states, errors naming the bad value.
* Tracking: real MoE layers on 2 and 4 gloo ranks (ep2, dp2, ep2 x edp2, tp2 x ep2, pp2 x ep2),
  window and trace against hand sums of every rank's per-forward ``last_stats``, with and
  without a trace (the two reduction paths).
* Policies: greedy balances Zipf loads (<= 1.15 where static > 1.5), never worse with its
  swap refinement; network-aware at least halves greedy's cross-node routes on traffic with
  locality within (1 + slack) x greedy's imbalance; align moves few experts.
* Switching: the cost model by hand; a 2-rank controller with a fake ``migrate_fn`` switches a
  hot layer (one batched call), keeps a balanced one, does not flip back, and stays when the
  migration costs too much or the gain is under ``min_gain``; its JSONL log.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moe_plugin.placement.trace import TraceMeta, TraceWriter, read_trace


# --- gate traces ------------------------------------------------------------------------------

def _random_steps(meta: TraceMeta, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in steps:
        rec = {}
        for i, name in enumerate(meta.layers):
            load = torch.randint(0, 1000, (meta.num_experts,), generator=gen)
            traffic = torch.randint(0, 1000, (meta.ep_size, meta.num_experts), generator=gen)
            rec[name] = (load.numpy() if i % 2 else load, traffic)
        out.append((step, rec))
    return out


def test_trace_round_trip(tmp_path):
    meta = TraceMeta(["decoder.0", "decoder.2", "decoder.4"], num_experts=8, ep_size=4,
                     info={"world_size": 8, "ep_ranks": [[0, 2, 4, 6], [1, 3, 5, 7]]})
    records = _random_steps(meta, [3, 4, 7, 8])
    path = tmp_path / "gate.trace"
    with TraceWriter(path, meta) as writer:
        for step, rec in records:
            writer.append(step, rec)
    header = path.stat().st_size - 4 * meta.bytes_per_step
    assert meta.bytes_per_step == 8 + 4 * 3 * 8 * (1 + 4)
    trace = read_trace(path)
    assert trace.meta == meta and trace.layers == tuple(meta.layers)
    assert trace.load.shape == (4, 3, 8) and trace.traffic.shape == (4, 3, 4, 8)
    assert trace.steps.tolist() == [3, 4, 7, 8]
    for s, (step, rec) in enumerate(records):
        for name, (load, traffic) in rec.items():
            i = trace.layer(name)
            assert np.array_equal(trace.load[s, i], np.asarray(load))
            assert np.array_equal(trace.traffic[s, i], traffic.numpy())
    assert torch.equal(trace.torch()["traffic"][1, 2], records[1][1]["decoder.4"][1])
    # a writer killed mid-record: the torn record is ignored, append resumes after the last whole one
    with open(path, "ab") as handle:
        handle.write(b"\x01" * 17)
    assert read_trace(path).steps.tolist() == [3, 4, 7, 8]
    with TraceWriter(path, meta.to_json(), append=True) as writer:
        writer.append(9, records[0][1])
    again = read_trace(path)
    assert again.steps.tolist() == [3, 4, 7, 8, 9]
    assert path.stat().st_size == header + 5 * meta.bytes_per_step


def test_trace_without_ep_writes_load_as_traffic(tmp_path):
    meta = TraceMeta(["l0"], num_experts=4)
    with TraceWriter(tmp_path / "t", meta) as writer:
        writer.append(0, {"l0": ([1, 2, 3, 4], None)})
    trace = read_trace(tmp_path / "t")
    assert trace.traffic.tolist() == [[[[1, 2, 3, 4]]]] and trace.kept().tolist() == [[[1, 2, 3, 4]]]


def test_trace_errors_name_the_bad_value(tmp_path):
    meta = TraceMeta(["a", "b"], num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="distinct"):
        TraceMeta(["a", "a"], num_experts=4)
    with pytest.raises(ValueError, match="num_experts must be a positive integer, got 0"):
        TraceMeta(["a"], num_experts=0)
    writer = TraceWriter(tmp_path / "t", meta)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        writer.append(0, {"a": ([0] * 4, [[0] * 4] * 2), "c": ([0] * 4, [[0] * 4] * 2)})
    with pytest.raises(ValueError, match=r"layer a traffic has shape \(4,\), expected \(2, 4\)"):
        writer.append(0, {"a": ([0] * 4, [0] * 4), "b": ([0] * 4, [[0] * 4] * 2)})
    with pytest.raises(ValueError, match="outside 0..2147483647"):
        writer.append(0, {"a": ([2 ** 31] * 4, [[0] * 4] * 2), "b": ([0] * 4, [[0] * 4] * 2)})
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.append(1, {})
    with pytest.raises(ValueError, match="cannot append .* E=4, P=2, not"):
        TraceWriter(tmp_path / "t", TraceMeta(["a", "b"], num_experts=8, ep_size=2), append=True)
    (tmp_path / "junk").write_bytes(b"NOTATRACE_______")
    with pytest.raises(ValueError, match="starts with b'NOTATRAC'"):
        read_trace(tmp_path / "junk")


# --- load tracking on gloo ranks ---------------------------------------------------------------

TRACK_E, TRACK_H, TRACK_F, TRACK_STEPS, TRACK_MICRO, TRACK_WINDOW = 4, 8, 16, 3, 2, 2


class _Stage(torch.nn.Module):
    """One or two MoE layers (``layer_index`` as Megatron's MLP has) applied in turn."""

    def __init__(self, config, groups, indices):
        super().__init__()
        from moe_plugin.layers import MoELayer
        self.moe = torch.nn.ModuleList()
        for i in indices:
            layer = MoELayer(config, TRACK_H, TRACK_F, groups, seed=5 + i, init_std=0.5)
            layer.layer_index = i
            self.moe.append(layer)

    def forward(self, x):
        for layer in self.moe:
            x = x + layer(x)[0]
        return x


def _track_child(rank, world_size, layouts, trace_dir):
    from moe_plugin.configs import MoEConfig
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.placement.tracking import LoadTracker

    out = {}
    for key, sizes in layouts.items():
        layout = RankLayout.build(world_size, **sizes)
        groups = build_process_groups(layout)
        try:
            s = layout.sizes
            config = MoEConfig.from_dict({"num_experts": TRACK_E, "router": "gshard", "second_expert_policy": "all",
                                          "capacity_factor": 1.0, "min_capacity": 1, "parallel": {
                                              "tensor": s.tp, "pipeline": s.pp, "expert": s.ep,
                                              "expert_tensor": s.etp, "order": s.order}})
            c = layout.coords(rank)
            indices = [c["pp"]] if s.pp > 1 else [0, 1]
            model = _Stage(config, groups, indices).train()
            plain = LoadTracker(model, TRACK_WINDOW)
            traced = LoadTracker(model, TRACK_WINDOW, trace_path=f"{trace_dir}/{key}.trace", trace_info={"case": key})
            forwards = []
            for step in range(TRACK_STEPS):
                for micro in range(TRACK_MICRO):
                    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + c["dp"])
                    x = torch.randn(4, 3, TRACK_H, generator=gen)
                    with torch.no_grad():
                        model(x)
                    forwards.append({(layer.layer_index): (layer.last_stats.routed_per_expert.clone(),
                                                           layer.last_stats.kept_per_expert.clone())
                                     for layer in model.moe})
                traced.end_step(step + 10)
                plain.end_step(step + 10)
            names = {name: layer.layer_index for name, layer in plain.layers.items()}
            out[key] = {"coords": c, "forwards": forwards, "needs_reduce": plain.needs_reduce,
                        "plain": {names[n]: w for n, w in plain.window_loads().items()},
                        "traced": {names[n]: w for n, w in traced.window_loads().items()}}
            plain.close()
            traced.close()
        finally:
            destroy_process_groups(groups)
    return out


TRACK_LAYOUTS = {
    2: {"ep2": {"ep": 2}, "dp2": {}},
    4: {"ep2_edp2": {"ep": 2}, "tp2_ep2": {"tp": 2, "ep": 2}, "pp2_ep2": {"pp": 2, "ep": 2}},
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tracking_matches_hand_sums(dist_run, tmp_path, world_size):
    """Window traffic [p, e] = kept routes of every rank at EP index p over the last window steps;
    the trace's load = routed summed over all ranks, traffic as the window's; per step."""
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.placement.trace import read_trace

    layouts = TRACK_LAYOUTS[world_size]
    results = dist_run(_track_child, world_size, layouts, str(tmp_path))
    for key, sizes in layouts.items():
        s = RankLayout.build(world_size, **sizes).sizes
        per_rank = [r[key] for r in results]
        layers = sorted({i for r in per_rank for i in r["plain"]})
        assert per_rank[0]["needs_reduce"] == (s.tp * s.dp != s.ep), key
        trace = read_trace(tmp_path / f"{key}.trace")
        assert trace.layers == tuple(f"layer{i}" for i in layers) and trace.meta.info["case"] == key
        assert trace.steps.tolist() == [10 + i for i in range(TRACK_STEPS)] and trace.ep_size == s.ep
        for i in layers:
            holders = [r for r in per_rank if i in r["plain"]]
            load = torch.zeros(TRACK_STEPS, TRACK_E, dtype=torch.int64)
            traffic = torch.zeros(TRACK_STEPS, s.ep, TRACK_E, dtype=torch.int64)
            for r in holders:
                # the EP index of a rank: its position in its EP group (the expert grid's "ep")
                p = r["coords"].get("ep", 0)
                for f, fwd in enumerate(r["forwards"]):
                    routed, kept = fwd[i]
                    load[f // TRACK_MICRO] += routed
                    traffic[f // TRACK_MICRO, p] += kept
            window = traffic[-TRACK_WINDOW:].sum(0)
            for r in holders:
                for kind in ("plain", "traced"):
                    got = r[kind][i]
                    assert got.steps == TRACK_WINDOW, (key, i, kind, got)
                    assert torch.equal(got.traffic_PE, window), (key, i, kind, got, window)
            t = trace.layer(f"layer{i}")
            assert np.array_equal(trace.load[:, t], load.numpy()), (key, i)
            assert np.array_equal(trace.traffic[:, t], traffic.numpy()), (key, i)
            assert (trace.load[:, t].sum(-1) == 2 * 12 * s.dp * TRACK_MICRO).all()  # top-2, 12 tokens per replica
            assert (trace.kept()[:, t] <= trace.load[:, t]).all() and (trace.kept()[:, t] < trace.load[:, t]).any()


# --- policies ---------------------------------------------------------------------------------

def _zipf(E, s=0.8, scale=1000.0):
    return (scale / (torch.arange(E) + 1.0) ** s).round()


def test_static_and_imbalance():
    from moe_plugin.placement.policies import imbalance, rank_loads, static
    assert static(8, 2).tolist() == list(range(8))
    load = torch.tensor([4, 0, 0, 0, 1, 1, 1, 1])
    assert rank_loads(load, static(8, 2), 2).tolist() == [4.0, 4.0]
    assert imbalance(load, torch.tensor([0, 4, 5, 6, 1, 2, 3, 7]), 2) == pytest.approx(7 / 4)
    assert imbalance(torch.zeros(8), static(8, 2), 2) == 1.0
    with pytest.raises(ValueError, match="6 experts cannot be spread evenly over 4 EP ranks"):
        static(6, 4)


@pytest.mark.parametrize("E,P", [(32, 4), (64, 4), (64, 2)])
def test_greedy_balances_zipf(E, P):
    from moe_plugin.placement.policies import check_placement, greedy, imbalance, static
    load = _zipf(E)
    placement = check_placement(greedy(load, P), E)
    assert imbalance(load, static(E, P), P) > 1.5
    assert imbalance(load, placement, P) <= 1.15
    assert torch.equal(greedy(load, P), placement)                       # deterministic


def test_greedy_refinement_never_worse():
    from moe_plugin.placement.policies import greedy, imbalance
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        load = (torch.rand(16, generator=gen) ** 3 * 1000).round()
        assert imbalance(load, greedy(load, 4), 4) <= imbalance(load, greedy(load, 4, refine=False), 4) + 1e-12


def _local_traffic(load, P, gen):
    """Each expert's tokens come mostly from one 'home' EP rank and its node neighbour."""
    E = len(load)
    traffic = torch.zeros(P, E)
    home = torch.randint(0, P, (E,), generator=gen)
    for e in range(E):
        w = torch.full((P,), 0.05)
        w[home[e]] = 1.0
        w[home[e] ^ 1] = 0.5
        traffic[:, e] = (w / w.sum() * load[e]).round()
    return traffic


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_network_aware_cuts_cross_node_routes(seed):
    from moe_plugin.placement.policies import cross_node_routes, greedy, imbalance, network_aware
    E, P, per_node, slack = 32, 8, 2, 0.1
    traffic = _local_traffic(_zipf(E), P, torch.Generator().manual_seed(seed))
    load = traffic.sum(0)
    node = [p // per_node for p in range(P)]
    g, na = greedy(load, P), network_aware(load, traffic, P, ranks_per_node=per_node, slack=slack)
    assert cross_node_routes(traffic, na, node) <= 0.5 * cross_node_routes(traffic, g, node)
    assert imbalance(load, na, P) <= (1 + slack) * imbalance(load, g, P) + 1e-9


def test_network_aware_keeps_experts_with_their_senders():
    """8 equal experts, 2 nodes of 2 ranks: experts 0-3 are fed by node 1, 4-7 by node 0."""
    from moe_plugin.placement.policies import cross_node_routes, greedy, network_aware, rank_of
    traffic = torch.zeros(4, 8)
    traffic[2:, :4] = 50
    traffic[:2, 4:] = 50
    load = traffic.sum(0)
    na = network_aware(load, traffic, 4, [0, 0, 1, 1])
    assert cross_node_routes(traffic, na, [0, 0, 1, 1]) == 0 < cross_node_routes(traffic, greedy(load, 4), [0, 0, 1, 1])
    assert sorted(rank_of(na, 4).tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert network_aware(load, traffic, 4, [0, 0, 0, 0]).tolist() == greedy(load, 4).tolist()  # one node
    with pytest.raises(ValueError, match=r"traffic_PE must have shape \(P, E\) = \(4, 8\), got \(2, 8\)"):
        network_aware(load, traffic[:2], 4, ranks_per_node=2)
    with pytest.raises(ValueError, match="node_of_rank or ranks_per_node"):
        network_aware(load, traffic, 4)


def test_align_moves_few_experts():
    from moe_plugin.placement.policies import align, greedy, moved_experts, rank_loads
    load = _zipf(16)
    current = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    new = greedy(load, 4)
    aligned = align(new, current, 4)
    assert sorted(rank_loads(load, aligned, 4).tolist()) == sorted(rank_loads(load, new, 4).tolist())
    assert len(moved_experts(current, aligned, 4)) <= len(moved_experts(current, new, 4))
    assert moved_experts(current, align(current, current, 4)) == []       # nothing to move
    # a relabelling of ranks is recognised as free
    relabelled = (current + 4) % 16
    assert moved_experts(current, align(relabelled, current, 4), 4) == []
    with pytest.raises(ValueError, match="distinct slot"):
        align(torch.zeros(16, dtype=torch.long), current, 4)


# --- switching --------------------------------------------------------------------------------

def test_cost_model_by_hand():
    """2 ranks on 2 nodes, 2 experts: rank 0 sends 10 routes to expert 1 (on rank 1), rank 1
    sends 4 to expert 0; expert 0 also gets 6 from rank 0, expert 1 gets 2 from rank 1."""
    from moe_plugin.placement.costs import CostModel
    cost = CostModel(seconds_per_route=1.0, seconds_per_byte_intra=0.0, seconds_per_byte_inter=0.5)
    T = torch.tensor([[6.0, 10.0], [4.0, 2.0]])
    t = cost.layer_time(T, torch.tensor([0, 1]), [0, 1], bytes_per_route=2.0)
    assert t.compute == 12.0                       # rank 1: 10 + 2 routes
    assert t.all_to_all == 10 * 2.0 * 0.5          # rank 0 sends 10, receives 4; rank 1 the reverse
    assert cost.layer_time(T, torch.tensor([0, 1]), [0, 0], 2.0).all_to_all == 0.0   # one node, free intra
    assert cost.fit([10.0, 20.0], [1.0, 2.0]).seconds_per_route == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"need a nonzero sample"):
        cost.fit([0.0], [1.0])


CTRL_E = 4


def _controller_child(rank, world_size, run_dir, variants):
    import json

    from moe_plugin.configs import MoEConfig
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.layers import MoELayer
    from moe_plugin.placement.controller import PlacementController
    from moe_plugin.placement.costs import CostModel

    groups = build_process_groups(RankLayout.build(world_size, ep=2))
    out = {}
    try:
        for key, variant in variants.items():
            config = MoEConfig.from_dict({"num_experts": CTRL_E, "router": "gshard", "second_expert_policy": "all",
                                          "drop_tokens": False, "parallel": {"expert": 2},
                                          "placement": {"policy": "greedy", "check_interval": 2, "window": 2,
                                                        "min_gain": variant.get("min_gain", 0.05)}})
            model = torch.nn.ModuleDict({"hot": MoELayer(config, 8, 16, groups, seed=1),
                                         "even": MoELayer(config, 8, 16, groups, seed=2)}).train()
            with torch.no_grad():        # hot: experts 0 and 1 (both on EP rank 0); even: 0 and 2
                model["hot"].router.expert_bias.copy_(torch.tensor([50.0, 50.0, 0.0, 0.0]))
                model["even"].router.expert_bias.copy_(torch.tensor([50.0, 0.0, 50.0, 0.0]))
            calls = []

            def migrate(new, model=model, calls=calls):
                calls.append({k: v.tolist() for k, v in new.items()})
                for name, placement in new.items():   # a stand-in: the slots change, the weights do not
                    model[name].experts.placement.copy_(placement)
                return None

            moved = variant.get("moved_bytes")
            ctrl = PlacementController(model, config.placement, migrate, groups=groups, run_dir=f"{run_dir}/{key}",
                                       cost=CostModel(seconds_per_route=1e-3, migration_seconds_per_byte=1e-9),
                                       **({"moved_bytes_fn": lambda *_: moved} if moved else {}))
            checks = []
            for step in range(4):
                with torch.no_grad():
                    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(step * 7 + rank))
                    model["even"](model["hot"](x)[0])
                checks.append([d.__dict__ for d in ctrl.step(step, layer_seconds={"hot": 0.5})])
            ctrl.close()
            log = Path(f"{run_dir}/{key}/placement.jsonl")
            out[key] = {"calls": calls, "checks": checks,
                        "placements": {n: m.placement.tolist() for n, m in model.items()},
                        "log": [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else None}
    finally:
        destroy_process_groups(groups)
    return out


@pytest.mark.slow
def test_controller_switches_only_when_it_pays(dist_run, tmp_path):
    variants = {"switch": {}, "costly": {"moved_bytes": 10 ** 12}, "greedy_gain": {"min_gain": 0.6}}
    (tmp_path / "switch").mkdir()
    (tmp_path / "switch" / "placement.jsonl").write_text('{"event": "switch", "from": "an older run"}\n')
    results = dist_run(_controller_child, 2, str(tmp_path), variants)
    for key in variants:   # both ranks decide alike
        assert results[0][key]["calls"] == results[1][key]["calls"]
        assert results[0][key]["placements"] == results[1][key]["placements"]

    r = results[0]["switch"]
    assert [len(c) for c in r["checks"]] == [0, 2, 0, 2]   # checks after steps 1 and 3
    first = {d["layer"]: d for d in r["checks"][1]}
    assert first["hot"]["switch"] and first["hot"]["imbalance_now"] == 2.0 and first["hot"]["imbalance_new"] == 1.0
    assert not first["even"]["switch"] and "keeps" in first["even"]["reason"]
    assert r["calls"] == [{"hot": first["hot"]["placement"]}]        # one batched call, the switching layer
    hot = r["placements"]["hot"]
    assert sorted(hot) == [0, 1, 2, 3] and hot[0] // 2 != hot[1] // 2      # the two hot experts split
    second = {d["layer"]: d for d in r["checks"][3]}
    assert not second["hot"]["switch"]                               # balanced now: no flip back
    assert second["hot"]["predicted_at_last_check"] == pytest.approx(first["hot"]["seconds_new"])
    assert second["hot"]["realised_seconds"] == pytest.approx(second["hot"]["seconds_now"])
    assert first["hot"]["measured_seconds"] == 0.5
    # one writer (no duplicates), and a new run's log (the older run's line is gone)
    events = [(e["event"], e.get("layer", e.get("layers"))) for e in r["log"]]
    assert events == [("check", "hot"), ("check", "even"), ("switch", ["hot"]), ("check", "hot"), ("check", "even")]
    assert r["log"][2]["moved_bytes"] == first["hot"]["moved_bytes"] > 0

    costly = {d["layer"]: d for d in results[0]["costly"]["checks"][1]}
    assert not costly["hot"]["switch"] and "migration" in costly["hot"]["reason"]
    assert results[0]["costly"]["calls"] == []
    greedy_gain = {d["layer"]: d for d in results[0]["greedy_gain"]["checks"][1]}
    assert not greedy_gain["hot"]["switch"] and "min_gain" in greedy_gain["hot"]["reason"]


class _FakeAccelerator:
    """DeepSpeed's accelerator as a GPU's would answer (its device the meta device here)."""

    def device_name(self):
        return "cuda"

    def current_device_name(self):
        return "meta"


def test_nccl_branches_take_the_accelerators_device(monkeypatch):
    """Lines that run only on an accelerator, reached with a faked one: a collective of the load
    tracker (or the controller's switch flag) over a non-gloo group with no counts of its own (a
    stage without MoE layers) uses the accelerator's device, and the controller's default prices
    on it are ``CostModel``'s defaults, not the CPU's."""
    import deepspeed.accelerator
    import torch.distributed as dist
    from moe_plugin.integration.placement import _default_cost
    from moe_plugin.placement.costs import CostModel
    from moe_plugin.placement.tracking import collective_device

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", _FakeAccelerator)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert collective_device(None, {}) == torch.device("meta")
    assert collective_device(None, {"x": torch.zeros(1)}) == torch.device("cpu")     # the counts' own
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device(None, {}) == torch.device("cpu")
    assert _default_cost({"layer": object()}) == CostModel()
