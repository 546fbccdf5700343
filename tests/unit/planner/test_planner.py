"""The planner: its model (the run's DeepSpeed JSON and shape), cost model sanity, layout search, trace-replay
simulator, ``moe-plugin plan`` end to end (the commands docs/planner.md shows among them).

No process group and no timing assertion: the cost model is arithmetic, checked against hand
computations and against its own monotonicity; the simulator runs on synthetic traces.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from launcher import REPO
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.planner.cost_model import bubble_fraction, expert_rows, moe_layer_time, stage_memory, step_cost
from moe_plugin.planner.search import candidate_pool, ds_config, layouts, search
from moe_plugin.planner.spec import ClusterSpec, Layout, ModelShape, PlanModel, PlanOptions

EXAMPLES = REPO / "examples" / "gpt_moe" / "planner"
# a 4-layer GPT with dropless MoE on layers 0 and 2, trained in fp32 (no bf16 in its JSON: 4-byte values)
SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=512, seq_length=32)
MOE = dict(num_experts=8, drop_tokens=False, layer_interval=2)
DS = {"train_batch_size": 16, "moe": MOE}
OPTIONS = {"micro_batches": [1, 2, 4]}
CLUSTER = dict(nodes=2, gpus_per_node=4, flops=1e12, memory=16e9, intra_bandwidth=100e9, inter_bandwidth=10e9)


def model(**kw) -> PlanModel:
    """The test model with shape fields, planner options and "moe" block keys of ``kw`` changed."""
    shape = {**SHAPE, **{k: v for k, v in kw.items() if k in ModelShape.model_fields}}
    options = {**OPTIONS, **{k: v for k, v in kw.items() if k in PlanOptions.model_fields}}
    moe = {**MOE, **{k: v for k, v in kw.items() if k not in shape and k not in options}}
    if "capacity_factor" in kw:
        del moe["drop_tokens"]
    return PlanModel.build({**DS, "moe": moe}, shape, options)


def cluster(**kw) -> ClusterSpec:
    return ClusterSpec.load({**CLUSTER, **kw})


def layout(**kw) -> Layout:
    base = dict(tp=1, pp=1, ep=1, etp=1, dp=8, zero=1, micro_batch=2, gas=1)
    return Layout(**{**base, **kw})


# --- cost model ------------------------------------------------------------------------------------
def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    m, c = model(), cluster(layer_overhead=0.0)
    micro = lambda cost: cost.total - cost.dp_comm - cost.optimizer - cost.overhead   # noqa: E731
    cost, longer = (step_cost(m, c, layout(pp=2, dp=4, micro_batch=1, gas=g)) for g in (4, 5))
    slowest = micro(longer) - micro(cost)                     # one more micro-batch of the slowest stage
    assert cost.bubble == pytest.approx(micro(cost) - 4 * slowest)     # fill + drain: the other stage once
    assert 0 < cost.bubble <= slowest
    even = model(vocab_size=1, seq_length=8)                  # nearly equal stages: the textbook bubble
    cost = step_cost(even, c, layout(pp=2, dp=4, micro_batch=1, gas=4))
    assert cost.bubble == pytest.approx(bubble_fraction(2, 4) * micro(cost), rel=0.05)


def test_time_grows_with_tokens_and_skew():
    m, c = model(), cluster()
    times = [step_cost(model(seq_length=s), c, layout()).total for s in (16, 32, 64, 128)]
    assert times == sorted(times) and len(set(times)) == 4
    uniform = np.full(8, 1 / 8)
    skewed = np.array([0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    ep4 = layout(ep=4, dp=8)
    t_uniform = moe_layer_time(m, c, ep4, uniform)
    t_skewed = moe_layer_time(m, c, ep4, skewed)
    assert t_skewed["experts"] > t_uniform["experts"]
    assert t_skewed["all_to_all"] > t_uniform["all_to_all"]
    # a placement that pairs the hot expert with cold ones evens the ranks out
    rows = expert_rows(m, ep4, skewed)
    assert rows.sum() == pytest.approx(4 * 1 * 2 * 2 * 32)   # ep * etp senders, k routes per token, T = 64
    assert rows.max() == pytest.approx(rows[0])


def test_capacity_caps_the_hot_expert():
    skewed = np.array([0.9] + [0.1 / 7] * 7)
    ep = layout(ep=8)
    dropless = expert_rows(model(), ep, skewed)
    capped = expert_rows(model(capacity_factor=1.0), ep, skewed)
    assert dropless[0] == pytest.approx(8 * 0.9 * 2 * 64)
    assert capped[0] == pytest.approx(8 * 2 * 64 / 8)   # capacity = 1.0 * routes / E per sender


def test_memory_by_zero_stage_matches_hand_computation():
    m = model()
    H, F, V, S, E = 64, 256, 512, 32, 8
    dense = 4 * (4 * H * H + 8 * H) + 2 * (2 * H * F + F + H) + 2 * H * E + (V + S) * H + V * H
    expert = 2 * (E // 2) * 2 * H * F                   # 2 MoE layers, ep 2: 4 experts each
    assert m.total_params() == dense + 2 * E * 2 * H * F
    for zero in (0, 1, 2):
        lay = layout(ep=2, dp=8, zero=zero)          # edp = tp * dp / (etp * ep) = 4
        mem = stage_memory(m, lay, range(4), True, True, 1)
        assert mem["weights"] == pytest.approx(4 * (dense + expert))
        shard = dense / 8 + expert / 4
        assert mem["grads"] == pytest.approx(4 * (dense + expert if zero < 2 else shard))
        assert mem["optimizer"] == pytest.approx(8 * (dense + expert if zero < 1 else shard))


def test_tensor_parallel_splits_compute_and_pipeline_adds_bubble():
    m, c = model(hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8), cluster()
    one = step_cost(m, c, layout(dp=8))
    tp2 = step_cost(m, c, layout(tp=2, etp=2, dp=4))
    assert tp2.compute < one.compute and tp2.tp_comm > 0 == one.tp_comm
    pp = step_cost(m, c, layout(pp=2, dp=4, micro_batch=1, gas=4))
    assert pp.bubble > 0 and pp.pp_comm > 0


# --- search -----------------------------------------------------------------------------------------
def test_search_yields_only_valid_layouts():
    m, c = model(), cluster()
    found = list(layouts(m, c))
    assert found
    for lay in found:
        assert lay.world_size == 8 and lay.dp * lay.micro_batch * lay.gas == m.global_batch
        assert m.moe.num_experts % lay.ep == 0 and (lay.tp * lay.dp) % (lay.ep * lay.etp) == 0
        assert lay.tp <= c.gpus_per_node and m.shape.num_attention_heads % lay.tp == 0
        if lay.pp > 1:
            assert lay.zero in (0, 1)
        config = MoEConfig.from_dict(ds_config(m, lay)["moe"])
        sizes = config.check_world_size(8)
        assert (sizes.tp, sizes.pp, sizes.ep, sizes.etp, sizes.dp) == (lay.tp, lay.pp, lay.ep, lay.etp, lay.dp)
    shapes = {(lay.tp, lay.pp, lay.ep) for lay in found}
    assert {(1, 1, 8), (2, 1, 2), (1, 2, 2), (2, 2, 1)} <= shapes
    assert (1, 8, 1) not in shapes          # 4 layers cannot make 8 stages
    assert (1, 4, 1) not in shapes          # stages of layers 1 and 3 would hold no MoE layer (ZeRO-1 needs all)


def test_search_excludes_layouts_that_do_not_fit():
    m = model(hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, layer_interval=1)
    roomy = search(m, cluster())
    tight_memory = sorted(c.cost.memory_total for c in roomy)[len(roomy) // 2] / 0.9
    tight = search(m, cluster(memory=tight_memory))
    assert any(not c.fits for c in tight) and any(c.fits for c in tight)
    fitting = [c for c in tight if c.fits]
    assert all(c.cost.memory_total <= tight_memory * 0.9 for c in fitting)
    assert tight[:len(fitting)] == fitting                         # fitting ones rank first
    assert [c.time for c in fitting] == sorted(c.time for c in fitting)
    pool = candidate_pool(tight, 3)
    assert len(pool) == 3 and len({c.shape for c in pool}) == 3 and all(c.fits for c in pool)


# --- bad input (of the model: tests/unit/planner/test_planner_model.py) -------------------------------------------
def test_bad_cluster_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster\.flops: missing"):
        ClusterSpec.load({k: v for k, v in CLUSTER.items() if k != "flops"})
    with pytest.raises(ConfigError, match=r"cluster\.gemm_efficiency: .*increase"):
        ClusterSpec.load({**CLUSTER, "gemm_efficiency": [[1e9, 0.5], [1e8, 0.6]]})
    path = tmp_path / "c.json"
    path.write_text("{nodes: 1}")
    with pytest.raises(ConfigError, match=r"cluster file .*c\.json: got invalid JSON at line 1"):
        ClusterSpec.load(path)


def test_example_jsons_load():
    for name, shape in (("gpt_moe_125m_e8", "gpt_moe_125m_shape"), ("gpt_moe_125m_e64", "gpt_moe_125m_shape"),
                        ("tiny_cpu", "tiny_cpu_shape")):
        PlanModel.build(EXAMPLES / f"{name}.json", EXAMPLES / f"{shape}.json")
    assert ClusterSpec.load(EXAMPLES / "cluster_8x8_a100.json").world_size == 64
    cpu = ClusterSpec.load(EXAMPLES / "cluster_cpu_4ranks.json")      # what a calibration writes
    assert cpu.world_size == 4 and cpu.oversubscription == 2.0 and cpu.zero_step_overhead is not None
    json.loads((EXAMPLES / "cluster_8x8_a100.json").read_text())


# --- simulator --------------------------------------------------------------------------------------
def test_greedy_beats_static_on_skew_and_matches_it_on_uniform():
    from moe_plugin.planner.simulator import Policy, replay, synthetic_trace

    m, c = model(hidden_size=256, ffn_hidden_size=1024, num_experts=16), cluster()
    lay = layout(ep=4, dp=8)
    skewed, _ = synthetic_trace(60, 2, 16, 4096, zipf=1.2, drift_every=10, senders=4, seed=1)
    static = replay(m, c, lay, skewed, Policy("static"))
    greedy = replay(m, c, lay, skewed, Policy("greedy", interval=10))
    assert greedy.mean_s < static.mean_s and greedy.moves > 0 and greedy.migration_s > 0
    assert greedy.step_s[:10].tolist() == static.step_s[:10].tolist()     # static until the first check
    uniform, _ = synthetic_trace(40, 2, 16, 4096, zipf=0.0, senders=4, seed=2)
    static = replay(m, c, lay, uniform, Policy("static"))
    greedy = replay(m, c, lay, uniform, Policy("greedy", interval=10))
    assert greedy.moves == 0 and greedy.step_s.tolist() == static.step_s.tolist()


def test_shadowed_expert_leaves_the_all_to_all_and_pays_its_replication():
    from moe_plugin.planner.cost_model import replication_time

    m, c = model(hidden_size=256, ffn_hidden_size=1024), cluster()
    lay = layout(ep=4, dp=8)
    hot = np.array([0.65, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05])
    shadow = np.zeros(8, dtype=bool)
    shadow[0] = True
    plain = moe_layer_time(m, c, lay, hot)
    shadowed = moe_layer_time(m, c, lay, hot, shadow_E=shadow)
    assert "replication" not in plain and moe_layer_time(m, c, lay, hot, shadow_E=np.zeros(8, bool)) == plain
    assert shadowed["experts"] < plain["experts"] and shadowed["all_to_all"] < plain["all_to_all"]
    # two all-reduces over EP (weights forward, gradients backward) of one expert, inside a node here
    expected = 2 * (2 * 3 / 4 * m.expert_params() * m.options.param_bytes / c.intra_bandwidth + 2 * 3 * c.intra_latency)
    assert shadowed["replication"] == pytest.approx(expected) == replication_time(m, c, lay, 1)
    # every route to the hot expert from rank 0's tokens: rank 0 computes them all, as without shadowing
    senders = np.full((4, 8), 0.25)
    senders[:, 0] = [1.0, 0.0, 0.0, 0.0]
    one_sender = moe_layer_time(m, c, lay, hot, shadow_E=shadow, senders_PE=senders)
    assert one_sender["experts"] == pytest.approx(plain["experts"])
    assert one_sender["all_to_all"] == shadowed["all_to_all"]


def test_replay_shadows_the_hot_expert_when_it_pays():
    from moe_plugin.planner.simulator import Policy, replay, synthetic_trace

    m, c = model(hidden_size=256, ffn_hidden_size=1024), cluster()      # dropless, 2 experts per EP rank
    lay = layout(ep=4, dp=8)
    load, traffic = synthetic_trace(40, 2, 8, 4096, zipf=2.0, senders=4, seed=1)
    greedy = replay(m, c, lay, load, Policy("greedy", interval=10))
    shadow = replay(m, c, lay, load, Policy("greedy", interval=10, replica_budget=1), traffic_IMPE=traffic)
    assert shadow.policy.name == "greedy/10+shadow1"
    assert shadow.mean_s < greedy.mean_s and shadow.replication_s > 0
    assert shadow.shadow_steps == 30 and greedy.shadow_steps == 0 and greedy.replication_s == 0.0
    assert shadow.step_s[:10].tolist() == greedy.step_s[:10].tolist()     # nothing shadowed before the first check
    step, first = shadow.shadows[0]
    hottest = load[:10].sum(axis=0).argmax(axis=-1)                         # per layer
    assert step == 10 and [np.flatnonzero(first[j]).tolist() for j in range(2)] == [[e] for e in hottest]
    # a larger budget may shadow more, never replays slower here
    assert replay(m, c, lay, load, Policy("greedy", 10, replica_budget=2), traffic_IMPE=traffic).mean_s <= shadow.mean_s
    # budget 0 is greedy exactly, with or without the traffic
    zero = replay(m, c, lay, load, Policy("greedy", 10, replica_budget=0), traffic_IMPE=traffic)
    assert zero.step_s.tolist() == greedy.step_s.tolist() and zero.shadows == [] and zero.replication_s == 0.0
    # no shadowing without expert parallelism or with ETP
    for other in (layout(ep=1, dp=8), layout(tp=2, ep=4, etp=2, dp=4)):
        assert replay(m, c, other, load, Policy("greedy", 10, replica_budget=2)).shadow_steps == 0
    with pytest.raises(ValueError, match="replica_budget must be >= 0, got -1"):
        Policy("greedy", 10, replica_budget=-1)


def test_replay_shadows_nothing_on_a_uniform_load():
    from moe_plugin.planner.simulator import Policy, replay, synthetic_trace

    m, c = model(hidden_size=256, ffn_hidden_size=1024), cluster()
    lay = layout(ep=4, dp=8)
    uniform, traffic = synthetic_trace(40, 2, 8, 4096, zipf=0.0, senders=4, seed=2)
    greedy = replay(m, c, lay, uniform, Policy("greedy", 10))
    shadow = replay(m, c, lay, uniform, Policy("greedy", 10, replica_budget=2), traffic_IMPE=traffic)
    assert shadow.shadow_steps == 0 and shadow.shadows == [] and shadow.step_s.tolist() == greedy.step_s.tolist()


def test_synthetic_trace_shapes_and_trace_file_round_trip(tmp_path):
    from moe_plugin.placement.trace import TraceMeta, TraceWriter
    from moe_plugin.planner.plan import trace_load
    from moe_plugin.planner.simulator import synthetic_trace

    load, traffic = synthetic_trace(5, 2, 8, 256, senders=2)
    assert load.shape == (5, 2, 8) and traffic.shape == (5, 2, 2, 8)
    assert (load.sum(axis=-1) == 256).all() and (traffic.sum(axis=-2) == load).all()
    path = tmp_path / "gate.trace"
    with TraceWriter(path, TraceMeta(["layer0", "layer2"], num_experts=8, ep_size=2)) as w:
        for s in range(5):
            w.append(s, {"layer0": (load[s, 0], traffic[s, 0]), "layer2": (load[s, 1], traffic[s, 1])})
    assert (trace_load(path, model()) == load).all()
    with pytest.raises(ConfigError, match=r"--trace: .* has 8 experts per layer but moe\.num_experts is 16"):
        trace_load(path, model(num_experts=16))


# --- the command ------------------------------------------------------------------------------------
E8 = ["--config", str(EXAMPLES / "gpt_moe_125m_e8.json"), "--model-shape", str(EXAMPLES / "gpt_moe_125m_shape.json")]


def _write_specs(tmp_path) -> list[str]:
    """The test model's DeepSpeed JSON and shape JSON, and the test cluster, as the command's flags."""
    paths = {"config": DS, "model-shape": SHAPE, "cluster": CLUSTER}
    for name, content in paths.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return [*(a for name in paths for a in (f"--{name}", str(tmp_path / f"{name}.json"))), "--micro-batches", "1,2,4"]


def _plan(argv, capsys):
    from moe_plugin_tools.cli import main

    code = None
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_end_to_end_on_the_examples(tmp_path, capsys):
    out = tmp_path / "plan"
    code, stdout, _ = _plan([*E8, "--cluster", str(EXAMPLES / "cluster_8x8_a100.json"), "--out", str(out),
                             "--top", "3"], capsys)
    assert code == 0
    assert "valid layouts" in stdout and "step ms" in stdout and "mem GB" in stdout
    configs = sorted(out.glob("candidate_*.json"))
    assert len(configs) == 3 and (out / "plan.png").stat().st_size > 10_000
    assert "| rank | layout |" in (out / "plan.md").read_text()
    pool = json.loads((out / "pool.json").read_text())
    assert [e["rank"] for e in pool] == [1, 2, 3]
    times = [e["predicted_s"]["total"] for e in pool]
    assert times == sorted(times)
    for path, entry in zip(configs, pool):   # launch-ready: the "moe" block passes the plugin's checks
        ds = json.loads(path.read_text())
        config = MoEConfig.from_ds_config(ds)
        sizes = config.check_world_size(64)
        assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * sizes.dp
        # the online stage: with expert parallelism the runtime re-places experts (greedy, hysteresis)
        expected = "greedy" if sizes.ep > 1 else "static"
        assert config.placement.policy == expected and entry["placement"]["policy"] == expected
        if expected == "greedy":
            assert config.placement.check_interval == 100


def test_plan_with_a_trace_replays_the_pool(tmp_path, capsys):
    from moe_plugin.placement.trace import TraceMeta, TraceWriter
    from moe_plugin.planner.simulator import synthetic_trace

    load, traffic = synthetic_trace(30, 2, 8, 2048, zipf=1.2, drift_every=5, senders=1)
    path = tmp_path / "gate.trace"
    with TraceWriter(path, TraceMeta(["l0", "l2"], num_experts=8, ep_size=1)) as w:
        for s in range(30):
            w.append(s, {"l0": (load[s, 0], traffic[s, 0]), "l2": (load[s, 1], traffic[s, 1])})
    code, stdout, _ = _plan([*_write_specs(tmp_path), "--trace", str(path), "--out", str(tmp_path / "out"),
                             "--policy-interval", "5"], capsys)
    assert code == 0 and "Trace replay (30 steps" in stdout and "greedy/5 ms" in stdout
    # each member's JSON carries the placement the replay chose for its layout
    for entry in json.loads((tmp_path / "out" / "pool.json").read_text()):
        replay = entry["replay"]
        placement = json.loads((tmp_path / "out" / entry["config"]).read_text())["moe"]["placement"]
        faster = replay["greedy_ms"] < replay["static_ms"] and entry["layout"]["ep"] > 1
        assert placement == ({"policy": "greedy", "check_interval": 5} if faster else {"policy": "static"})
        assert entry["placement"] == placement


def _write_trace_and_specs(tmp_path, zipf=1.5):
    from moe_plugin.placement.trace import TraceMeta, TraceWriter
    from moe_plugin.planner.simulator import synthetic_trace

    load, traffic = synthetic_trace(30, 2, 8, 2048, zipf=zipf, drift_every=5, senders=1)
    path = tmp_path / "gate.trace"
    with TraceWriter(path, TraceMeta(["l0", "l2"], num_experts=8, ep_size=1)) as w:
        for s in range(30):
            w.append(s, {"l0": (load[s, 0], traffic[s, 0]), "l2": (load[s, 1], traffic[s, 1])})
    return [*_write_specs(tmp_path), "--trace", str(path), "--policy-interval", "5"]


def test_plan_replica_budget_replays_shadowing_and_sets_it_where_faster(tmp_path, capsys):
    args = _write_trace_and_specs(tmp_path, zipf=2.0)   # a hot expert no placement balances
    out = tmp_path / "out"
    code, plain, _ = _plan([*args, "--out", str(out)], capsys)
    before = (out / "pool.json").read_text()
    code0, zero, _ = _plan([*args, "--out", str(out), "--replica-budget", "0"], capsys)
    assert code == code0 == 0 and zero == plain and (out / "pool.json").read_text() == before   # as without the flag
    code, stdout, _ = _plan([*args, "--out", str(out), "--replica-budget", "2"], capsys)
    assert code == 0 and "greedy/5+shadow2 ms" in stdout and "replication ms/step" in stdout
    shadowed = 0
    for entry in json.loads((out / "pool.json").read_text()):
        replay, lay = entry["replay"], entry["layout"]
        ds = json.loads((out / entry["config"]).read_text())
        placement = ds["moe"]["placement"]
        faster = (lay["ep"] > 1 and lay["etp"] == 1
                  and replay["shadow_ms"] < min(replay["greedy_ms"], replay["static_ms"]))
        assert replay["replica_budget"] == 2 and (replay["shadow_steps"] > 0 or not faster)
        assert ("replica_budget" in placement) == faster and entry["placement"] == placement
        if faster:
            shadowed += 1
            assert placement == {"policy": "greedy", "check_interval": 5, "replica_budget": 2}
            assert MoEConfig.from_ds_config(ds).placement.replica_budget == 2     # the runtime accepts it
    assert shadowed > 0


@pytest.mark.parametrize("value", ["-1", "x", "9"])
def test_plan_bad_replica_budget_exits_2_naming_the_flag(tmp_path, capsys, value):
    code, _, err = _plan([*_write_trace_and_specs(tmp_path), "--out", str(tmp_path / "o"), "--replica-budget", value],
                         capsys)
    assert code == 2 and "--replica-budget" in err


def test_plan_replica_budget_needs_a_trace(tmp_path, capsys):
    args = _write_specs(tmp_path)                        # model and cluster, no trace
    code, _, err = _plan([*args, "--out", str(tmp_path / "o"), "--replica-budget", "1"], capsys)
    assert code == 2 and "--replica-budget: got 1; needs --trace" in err


def test_placement_block_follows_the_replay():
    from moe_plugin.planner import Layout
    from moe_plugin.planner.plan import placement_block

    ep4, ep1 = Layout(tp=1, pp=1, ep=4, etp=1, dp=4, zero=1, micro_batch=1, gas=1), \
        Layout(tp=1, pp=1, ep=1, etp=1, dp=4, zero=1, micro_batch=1, gas=1)
    assert placement_block(ep4, 50) == {"policy": "greedy", "check_interval": 50}
    assert placement_block(ep1, 50) == {"policy": "static"}
    assert placement_block(ep4, 50, {"static_ms": 10.0, "greedy_ms": 8.0}) == {"policy": "greedy",
                                                                              "check_interval": 50}
    assert placement_block(ep4, 50, {"static_ms": 10.0, "greedy_ms": 10.0}) == {"policy": "static"}
    shadow = {"static_ms": 10.0, "greedy_ms": 10.0, "shadow_ms": 9.0, "replica_budget": 2}
    assert placement_block(ep4, 50, shadow) == {"policy": "greedy", "check_interval": 50, "replica_budget": 2}
    assert placement_block(ep1, 50, shadow) == {"policy": "static"}
    assert placement_block(ep4, 50, {**shadow, "shadow_ms": 10.0}) == {"policy": "static"}


def test_plan_bad_input_exits_2_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "shape.json"
    bad.write_text(json.dumps({**SHAPE, "hidden_size": 0}))
    code, _, err = _plan(["--config", str(EXAMPLES / "gpt_moe_125m_e8.json"), "--model-shape", str(bad),
                          "--cluster", str(EXAMPLES / "cluster_8x8_a100.json"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.startswith("error: shape.hidden_size: got 0;")
    code, _, err = _plan(["--cluster", str(EXAMPLES / "cluster_8x8_a100.json")], capsys)
    assert code == 2 and "--config: got None; required" in err
    small = tmp_path / "cluster.json"
    small.write_text(json.dumps({**CLUSTER, "memory": 1e6}))
    code, _, err = _plan([*E8, "--cluster", str(small), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "cluster.memory: got 1000000.0; no layout fits" in err


# --- calibration and validation (no measurement here) -------------------------------------------------
def test_calibration_measurements_make_a_cluster():
    from moe_plugin.planner.calibrate import LARGE, cluster_from

    rank = {"gemm": [[1e6, 1e9], [1e8, 4e9], [1e9, 5e9]], "all_reduce_small": 6e-4, "all_reduce_large": 0.05,
            "all_to_all_small": 3e-4, "all_to_all_large": 0.02, "adam_s_per_param": 1e-8}
    slower = {**rank, "gemm": [[1e6, 0.5e9], [1e8, 4e9], [1e9, 4e9]]}
    spec = ClusterSpec.load(cluster_from([rank, slower], 4))
    assert spec.flops == 4.5e9 and spec.gemm_efficiency == [[1e6, 0.1667], [1e8, 0.8889], [1e9, 1.0]]   # rank mean
    assert spec.intra_latency == pytest.approx(3e-4 / 3) and spec.allreduce_latency == pytest.approx(6e-4 / 6)
    assert spec.intra_bandwidth == pytest.approx(0.75 * 4 * LARGE / (0.02 - 3e-4))
    assert spec.allreduce_bandwidth == pytest.approx(1.5 * 4 * LARGE / (0.05 - 6e-4))
    assert spec.optimizer_rate == pytest.approx(1e8) and spec.world_size == 4


def _piece_times(truth: ClusterSpec, world: int) -> dict:
    """What ``measure_pieces`` would time on a machine that follows the cost model exactly."""
    from moe_plugin.planner import cost_model as cm
    from moe_plugin.planner.calibrate_pieces import PARAMS, TOKENS, ZERO, _layout, _model

    m = _model(world)
    dense = [cm.dense_layer_time(m, truth, _layout(world, micro_batch=mb), False)["compute"] + truth.layer_overhead
             for mb in TOKENS]
    moe = {str(ep): [sum(cm.moe_layer_time(m, truth, _layout(world, ep=ep, micro_batch=mb)).values()) for mb in TOKENS]
           for ep in (1, world)}
    head = [truth.logit_element_time * mb * m.shape.seq_length * m.shape.vocab_size for mb in TOKENS]
    engine = {}
    for zero in ZERO:
        fixed, per_param = truth.engine_step(zero)
        engine[str(zero)] = [fixed + p * per_param + (p if zero == 0 else p / world) / truth.optimizer_rate
                             + cm._gradient_sync(m, truth, _layout(world, zero=zero), p, 0.0) for p in PARAMS]
    return {"dense": dense, "head": head, "moe": moe, "engine": engine}


def test_piece_fit_recovers_the_fields_of_a_machine_that_follows_the_model():
    from moe_plugin.planner.calibrate_pieces import fit

    world = 4
    base = {**CLUSTER, "nodes": 1, "gpus_per_node": world, "allreduce_bandwidth": 2e9, "allreduce_latency": 1e-4,
            "intra_latency": 3e-4, "optimizer_rate": 1e8}
    hidden = dict(layer_overhead=2e-3, layer_element_time=4e-9, logit_element_time=1e-9, moe_layer_overhead=5e-3,
                  moe_element_time=7e-9,
                  zero_step_overhead=[4e-3, 6e-3, 8e-3], zero_param_time=[1e-9, 2e-9, 3e-9])
    truth = ClusterSpec.load({**base, **hidden})
    pieces = _piece_times(truth, world)
    got = ClusterSpec.load(fit(base, [pieces, pieces], world))
    for key, value in hidden.items():
        assert getattr(got, key) == pytest.approx(value, rel=1e-6), key
    assert got.step_overhead == pytest.approx(6e-3) and got.intra_latency == 3e-4


def test_ring_collectives_use_the_all_reduce_link_and_the_all_to_all_the_link():
    m, lay = model(), layout(ep=4, dp=4, gas=1)
    slow_ring = cluster(allreduce_bandwidth=1e9, allreduce_latency=1e-3)
    base, slow = step_cost(m, cluster(), lay), step_cost(m, slow_ring, lay)
    assert slow.dp_comm > base.dp_comm
    # the MoE layer's all-to-alls (rows, counts; the router's finite flags ride in the counts, or
    # take an all-to-all over the token ranks where EP is not those) run on the link, not the ring
    for lay in (layout(ep=4, dp=4, gas=1), layout(ep=2, dp=4, gas=1)):
        assert moe_layer_time(m, slow_ring, lay)["all_to_all"] == moe_layer_time(m, cluster(), lay)["all_to_all"]
        assert (moe_layer_time(m, cluster(intra_latency=1e-3), lay)["all_to_all"]
                > moe_layer_time(m, cluster(), lay)["all_to_all"])
    tp = layout(tp=2, ep=2, dp=2, gas=1)       # TP's token all-gathers and router-gradient all-reduce: the ring
    assert moe_layer_time(m, slow_ring, tp)["tp_comm"] > moe_layer_time(m, cluster(), tp)["tp_comm"]


def test_oversubscribed_bubble_runs_faster_and_engine_costs_follow_the_zero_stage():
    m, lay = model(), layout(pp=2, dp=4, micro_batch=1, gas=4)
    dedicated, shared = step_cost(m, cluster(), lay), step_cost(m, cluster(oversubscription=4.0), lay)
    per_micro = dedicated.bubble                                # pp - 1 = 1 slot at full time
    assert shared.bubble == pytest.approx(per_micro / 2)        # max(1/4, 1/pp) of it
    assert dedicated.total - shared.total == pytest.approx(per_micro / 2 + 2 * 1e-4 * 0.5)
    c = cluster(zero_step_overhead=[1e-3, 2e-3, 3e-3], zero_param_time=[0.0, 1e-9, 0.0])
    z1, z2 = step_cost(m, c, layout(zero=1)), step_cost(m, c, layout(zero=2))
    assert z2.overhead - z1.overhead == pytest.approx(1e-3)
    assert z1.optimizer > z2.optimizer
    with pytest.raises(ConfigError, match=r"cluster.zero_param_time: got \[1.0\]; expected \[stage_0"):
        cluster(zero_param_time=[1.0])


def test_validation_layouts_are_ones_the_search_finds():
    from moe_plugin.planner.validate import LAYOUTS, validation_model

    for world, chosen in LAYOUTS.items():
        m = validation_model(world)
        c = ClusterSpec.load({**CLUSTER, "nodes": 1, "gpus_per_node": world})
        assert set(chosen) <= set(layouts(m, c)), world
