"""The planner's model is the run's own description: its DeepSpeed JSON (the ``"moe"`` block parsed by
``MoEConfig``) and the model's shape. Every ``"moe"`` fact comes from the parsed block; the shape is given as a
JSON or Megatron-LM's flags; the old one-file form converts into the same plan; the commands docs/planner.md
shows run as written; bad input names the key or the flag.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from launcher import REPO
from commands import cli
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.planner.cost_model import expert_rows_by_expert, step_cost
from moe_plugin.planner.spec import BYTES, MICRO_BATCHES, ClusterSpec, Layout, PlanModel

EXAMPLES = REPO / "examples" / "gpt_moe" / "planner"
A100 = str(EXAMPLES / "cluster_8x8_a100.json")
SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=512, seq_length=32)
E64 = ["--config", str(EXAMPLES / "gpt_moe_125m_e64.json")]
E64_SHAPE = ["--model-shape", str(EXAMPLES / "gpt_moe_125m_shape.json")]
E64_FLAGS = ["--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-attention-heads", "12",
             "--vocab-size", "50304", "--seq-length", "2048"]
# the 64-expert example in the old one-file form, as it was committed
OLD_E64 = {"layers": 12, "hidden": 768, "ffn": 3072, "heads": 12, "vocab": 50304, "seq": 2048, "experts": 64,
           "top_k": 2, "capacity_factor": 1.25, "moe_layer_interval": 2, "global_batch": 256,
           "micro_batches": [1, 2, 4, 8], "param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12,
           "activation_bytes": 2}
# its pool as the planner computed it before the model came from the run's JSON (seconds, bytes per rank)
OLD_E64_POOL = [("tp2-ep16-dp32/z1/mb8x1", 0.1859461498884291, 17832114912.0),
                ("tp2-ep32-etp1-dp32/z1/mb8x1", 0.1873980959233496, 17530125024.0),
                ("tp2-ep16-etp1-dp32/z1/mb8x1", 0.187488108731506, 17756617440.0),
                ("tp2-ep32-dp32/z1/mb8x1", 0.18998558348027272, 17718868704.0),
                ("tp2-ep8-dp32/z1/mb8x1", 0.19114430078316044, 18058607328.0)]


def build(moe: dict, shape: dict = SHAPE, **ds) -> PlanModel:
    return PlanModel.build({"train_batch_size": 16, **ds, "moe": moe}, shape)


def lay(**kw) -> Layout:
    return Layout(**{**dict(tp=1, pp=1, ep=1, etp=1, dp=8, zero=1, micro_batch=2, gas=1), **kw})


def _pool(out: Path) -> list:
    return json.loads((out / "pool.json").read_text())


# --- every "moe" fact from the parsed block ---------------------------------------------------------
def test_moe_facts_come_from_the_parsed_block():
    switch = build({"num_experts": 8, "router": "switch"})
    assert switch.moe.k == 1 and switch.moe.drop_tokens and switch.moe.capacity_factor == 1.25
    ep8, T = lay(ep=8), 2 * 32                          # 8 senders of T tokens each
    assert expert_rows_by_expert(switch, ep8, np.full(8, 1 / 8)).sum() == pytest.approx(8 * T)   # k = 1
    assert build({"num_experts": 8, "layers": [1, 3]}).moe_layers == [1, 3]
    assert build({"num_experts": 8, "layer_interval": 2}).moe_layers == [0, 2]
    hot = np.eye(8)[0]                                # every route to expert 0: it keeps its capacity
    capped = expert_rows_by_expert(build({"num_experts": 8, "min_capacity": 0}), ep8, hot)
    raised = expert_rows_by_expert(build({"num_experts": 8, "min_capacity": 50}), ep8, hot)
    assert capped[0] == 8 * 20 and raised[0] == 8 * 50     # ceil(1.25 x 2 x 64 / 8) = 20, or min_capacity
    dropless = expert_rows_by_expert(build({"num_experts": 8, "drop_tokens": False}), ep8, hot)
    assert dropless[0] == 8 * 2 * T
    plain = build({"num_experts": 8})
    assert plain.expert_ffn == 256 and plain.expert_params() == 2 * 64 * 256
    glu = build({"num_experts": 8, "ffn_hidden_size": 128, "activation": "swiglu", "expert_linear_bias": True})
    assert glu.expert_ffn == 128 and glu.expert_params() == 64 * 256 + 128 * 64 + 256 + 64


def test_byte_sizes_follow_the_precision_unless_given():
    assert build({"num_experts": 8}).options.model_dump() == {"micro_batches": MICRO_BATCHES, **BYTES["fp32"]}
    half = build({"num_experts": 8}, bf16={"enabled": True})
    assert half.options.model_dump() == {"micro_batches": MICRO_BATCHES, **BYTES["half"]}
    given = PlanModel.build({"train_batch_size": 16, "fp16": {"enabled": True}, "moe": {"num_experts": 8}}, SHAPE,
                            {"activation_bytes": 1})
    assert given.options.activation_bytes == 1 and given.options.param_bytes == 2


def test_grouped_query_attention_shape():
    plain = build({"num_experts": 8})
    spelled = build({"num_experts": 8}, {**SHAPE, "num_query_groups": 4, "kv_channels": 16})
    c = ClusterSpec.load(dict(nodes=1, gpus_per_node=8, flops=1e12, memory=16e9, intra_bandwidth=1e11,
                              inter_bandwidth=1e10))
    assert step_cost(spelled, c, lay()).as_dict() == step_cost(plain, c, lay()).as_dict()
    gqa = build({"num_experts": 8}, {**SHAPE, "num_query_groups": 1})
    assert gqa.dense_layer_params() == plain.dense_layer_params() - 2 * 48 * (64 + 1)    # K, V: 16 wide, not 64
    assert step_cost(gqa, c, lay()).compute < step_cost(plain, c, lay()).compute
    assert gqa.shape.transformer_fields() == {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                             "ffn_hidden_size": 256, "num_query_groups": 1}   # TransformerConfig's


def test_candidate_is_the_runs_json_under_its_layout():
    from moe_plugin.planner.search import ds_config

    run = json.loads((REPO / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json").read_text())
    model = PlanModel.build(run, {**SHAPE, "vocab_size": 384})
    ds = ds_config(model, lay(ep=2, dp=4, micro_batch=2, gas=2, zero=0), {"policy": "greedy", "check_interval": 7})
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 2, 2)
    assert ds["zero_optimization"] == {**run["zero_optimization"], "stage": 0}
    for key in ("optimizer", "scheduler", "gradient_clipping", "bf16", "fp16", "csv_monitor"):
        assert ds[key] == run[key], key
    assert {k: v for k, v in ds["moe"].items() if k not in ("parallel", "placement")} == \
        {k: v for k, v in run["moe"].items() if k not in ("parallel", "placement")}
    config = MoEConfig.from_ds_config(ds)
    assert config.parallel.expert == 2 and config.placement.check_interval == 7


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ds, shape, match", [
    ({}, {"hidden_size": "64"}, r"^shape\.hidden_size: got '64'; expected"),
    ({}, {"num_attention_heads": 5}, r"^shape\.num_attention_heads: got 5; must divide hidden_size \(64\)"),
    ({}, {"num_query_groups": 3}, r"^shape\.num_query_groups: got 3; must divide num_attention_heads \(4\)"),
    ({}, {"hiden_size": 64}, r"^shape\.hiden_size: .*unknown key \(did you mean 'hidden_size'\?\)"),
    ({"moe": {"num_experts": 8, "router": "topk", "top_k": 9}}, {}, r"^moe\.top_k: got 9; must be at most "
                                                                    r"num_experts \(8\)"),
    ({"moe": {"num_experts": 8, "layers": [5]}}, {}, r"^moe\.layers: .*names layer 5, but the model has 4 layers "
                                                     r"\(shape\.num_layers\)"),
    ({"moe": {"num_experts": 8, "shared_expert_ffn_hidden_size": 64}}, {}, r"^moe\.shared_expert_ffn_hidden_size: "
                                                                           r"got 64; the planner does not price"),
    ({"train_batch_size": None}, {}, r"^train_batch_size: got None; expected an integer >= 1: the planner keeps"),
    ({"moe": None}, {}, r"^moe: got None; expected a JSON object"),
])
def test_bad_model_names_the_key(ds, shape, match):
    base = {"train_batch_size": 16, "moe": {"num_experts": 8}}
    with pytest.raises(ConfigError, match=match):
        PlanModel.build({**base, **ds}, {**SHAPE, **shape})


def test_missing_batch_and_bad_options_name_the_key():
    with pytest.raises(ConfigError, match=r"^train_batch_size: missing; expected an integer >= 1"):
        PlanModel.build({"moe": {"num_experts": 8}}, SHAPE)
    with pytest.raises(ConfigError, match=r"^options\.micro_batches: got \[\]; expected a non-empty list"):
        PlanModel.build({"train_batch_size": 8, "moe": {"num_experts": 8}}, SHAPE, {"micro_batches": []})


@pytest.mark.parametrize("argv, message", [
    ([*E64, "--num-layers", "12", "--hidden-size", "0", "--num-attention-heads", "12", "--vocab-size", "8",
      "--seq-length", "8"], "error: --hidden-size: got 0; expected an integer >= 1"),
    ([*E64, "--num-layers", "12", "--hidden-size", "768"], "error: --num-attention-heads: missing; required"),
    ([*E64, *E64_SHAPE, "--num-layers", "12"], "error: --num-layers: got 12; --model-shape gives the shape already"),
    ([*E64], "error: --model-shape: got None; required to plan: the model's shape as a JSON, or the flags"),
    ([*E64_SHAPE], "error: --config: got None; required to plan: the run's DeepSpeed JSON"),
    ([*E64, *E64_SHAPE, "--param-bytes", "0"], "error: --param-bytes: got 0; expected an integer >= 1"),
    ([*E64, *E64_SHAPE, "--micro-batches", "2,x"], "error: --micro-batches: got '2,x'; expected comma-separated"),
])
def test_plan_flags_errors_name_the_flag(tmp_path, capsys, argv, message):
    status, printed = cli(capsys, ["plan", *argv, "--cluster", A100, "--out", tmp_path / "o"])
    assert status == 2 and printed.strip().startswith(message), printed


def test_plan_help_states_the_micro_batch_default(capsys):
    status, printed = cli(capsys, ["plan", "--help"])
    assert status == 0 and f"(default {','.join(map(str, MICRO_BATCHES))})" in " ".join(printed.split())
    assert "--model MODEL.json the old form" in " ".join(printed.split())


# --- the command's three forms, and the documented commands ---------------------------------------------
def test_shape_json_flags_and_old_form_plan_alike_and_as_before(tmp_path, capsys):
    old = tmp_path / "old_e64.json"
    old.write_text(json.dumps(OLD_E64))
    forms = {"json": [*E64, *E64_SHAPE], "flags": [*E64, *E64_FLAGS], "old": ["--model", old]}
    pools = {}
    for name, argv in forms.items():
        status, printed = cli(capsys, ["plan", *argv, "--cluster", A100, "--out", tmp_path / name])
        assert status == 0, printed
        pools[name] = _pool(tmp_path / name)
        for entry in pools[name]:
            entry["candidate"] = json.loads((tmp_path / name / entry["config"]).read_text())
    assert pools["json"] == pools["flags"] == pools["old"]
    assert [(e["config"], e["predicted_s"]["total"], e["predicted_s"]["memory_total"]) for e in pools["json"]] == \
        [(f"candidate_{i}_{name.replace('/', '_')}.json", total, memory)
         for i, (name, total, memory) in enumerate(OLD_E64_POOL, 1)]


@pytest.mark.parametrize("bad, message", [
    ({"hidden": 0}, "error: model.hidden: got 0; expected an integer >= 1"),
    ({"expertz": 8}, "error: model.expertz: got 8; unknown key (did you mean 'experts'?)"),
    ({"global_batch": 0}, "error: model.global_batch: got 0; expected an integer >= 1"),
    ({"capacity_factor": None, "top_k": 1}, None),
])
def test_old_form_errors_name_its_keys(tmp_path, capsys, bad, message):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**OLD_E64, "experts": 8, **bad}))
    status, printed = cli(capsys, ["plan", "--model", old, "--cluster", A100, "--out", tmp_path / "o", "--top", "1"])
    if message is None:    # dropless top-1: a switch router without capacity
        assert status == 0, printed
        moe = json.loads(next((tmp_path / "o").glob("candidate_1_*.json")).read_text())["moe"]
        assert (moe["router"], moe["top_k"], moe["drop_tokens"]) == ("switch", 1, False)
        return
    assert status == 2 and printed.strip().startswith(message), printed
    status, printed = cli(capsys, ["plan", "--model", old, *E64, "--cluster", A100])
    assert status == 2 and "--model: got" in printed and "give it without --config" in printed


def _documented_commands() -> list[list[str]]:
    """The ``moe-plugin plan --config ...`` commands of docs/planner.md, continuation lines joined."""
    text = (REPO / "docs" / "planner.md").read_text().replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in re.findall(r"^moe-plugin plan --config .*$", text, re.M)]


def test_the_documented_commands_run(tmp_path, capsys, monkeypatch):
    commands = _documented_commands()
    assert len(commands) == 2, commands
    monkeypatch.chdir(REPO)                   # the documented paths are the repository's
    for i, argv in enumerate(commands):
        argv[argv.index("--out") + 1] = str(tmp_path / f"plan{i}")
        status, printed = cli(capsys, argv)
        assert status == 0, printed
        pool = _pool(tmp_path / f"plan{i}")
        assert len(pool) == int(argv[argv.index("--top") + 1])
        world = ClusterSpec.load(argv[argv.index("--cluster") + 1]).world_size
        for entry in pool:            # launch-ready: the plugin's own checks take every candidate
            MoEConfig.from_ds_config(json.loads((tmp_path / f"plan{i}" / entry["config"]).read_text())
                                     ).check_world_size(world)
