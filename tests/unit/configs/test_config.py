"""The "moe" block: malformed configs fail with a message naming key path, value and what is valid."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from launcher import REPO
from moe_plugin.configs import ConfigError, MoEConfig, ParallelConfig, ParallelSizes, PlacementConfig
from moe_plugin_tools.config_docs import full_example, render_markdown

EXAMPLE_4RANK = REPO / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json"


def message(path: str, got: str, valid: str) -> str:
    """A regex for ``<path>: <got>; ... <valid>`` with every part matched literally."""
    return f"^{re.escape(path)}: {re.escape(got)}; .*{re.escape(valid)}"


def with_experts(**fields) -> dict:
    return {"num_experts": 8, **fields}


# (block, key path, how the value is shown, a piece of what is valid)
MALFORMED_BLOCKS = {
    "experts as string": ({"num_experts": "8"}, "moe.num_experts", "got '8'",
                          "expected an integer >= 1 (write the number without quotes: 8, not '8')"),
    "experts as bool": ({"num_experts": True}, "moe.num_experts", "got True",
                        "expected an integer >= 1 (true/false is not a number)"),
    "experts as float": ({"num_experts": 8.0}, "moe.num_experts", "got 8.0", "expected an integer >= 1"),
    "experts missing": ({"top_k": 2}, "moe.num_experts", "missing", "required: an integer >= 1"),
    "experts zero": ({"num_experts": 0}, "moe.num_experts", "got 0", "expected an integer >= 1"),
    "top_k bool": (with_experts(router="topk", top_k=True), "moe.top_k", "got True",
                   "expected an integer >= 1, or null"),
    "capacity negative": (with_experts(capacity_factor=-1.0), "moe.capacity_factor", "got -1.0",
                          "expected a number > 0"),
    "capacity zero": (with_experts(capacity_factor=0), "moe.capacity_factor", "got 0", "expected a number > 0"),
    "capacity infinite": (with_experts(capacity_factor=float("inf")), "moe.capacity_factor", "got inf",
                          "expected a number > 0"),
    "eval capacity zero": (with_experts(eval_capacity_factor=0.0), "moe.eval_capacity_factor", "got 0.0",
                           "expected a number > 0"),
    "min capacity negative": (with_experts(min_capacity=-4), "moe.min_capacity", "got -4",
                              "expected an integer >= 0"),
    "unknown top-level key": (with_experts(top_kk=2), "moe.top_kk", "got 2",
                              "unknown key (did you mean 'top_k'?); valid keys: activation, aux_loss_coeff"),
    "unknown parallel key": (with_experts(parallel={"tensr": 2}), "moe.parallel.tensr", "got 2",
                             "unknown key (did you mean 'tensor'?); valid keys: expert, expert_tensor, order"),
    "unknown placement key": (with_experts(placement={"polcy": "greedy"}), "moe.placement.polcy",
                              "got 'greedy'", "unknown key (did you mean 'policy'?); valid keys: check_interval"),
    "parallel not an object": (with_experts(parallel=[2]), "moe.parallel", "got [2]",
                               "expected a JSON object with keys among tensor, pipeline, expert"),
    "tensor zero": (with_experts(parallel={"tensor": 0}), "moe.parallel.tensor", "got 0",
                    "expected an integer >= 1"),
    "order unknown token": (with_experts(parallel={"order": "tp-cp-ex-dp-pp"}), "moe.parallel.order",
                            "got 'tp-cp-ex-dp-pp'", "token 'ex' is unknown; tokens are tp, cp, ep, dp, pp"),
    "order repeated token": (with_experts(parallel={"order": "tp-ep-ep-dp-pp"}), "moe.parallel.order",
                             "got 'tp-ep-ep-dp-pp'", "repeats ep; each token at most once, e.g. 'tp-cp-ep-dp-pp'"),
    "order missing token": (with_experts(parallel={"order": "tp-cp-dp-pp"}), "moe.parallel.order",
                            "got 'tp-cp-dp-pp'", "lacks ep; it must name tp, ep, dp and pp"),
    "order not a string": (with_experts(parallel={"order": 5}), "moe.parallel.order", "got 5", "expected a string"),
    "sequence_parallel string": (with_experts(parallel={"sequence_parallel": "yes"}),
                                 "moe.parallel.sequence_parallel", "got 'yes'", "expected true or false"),
    "experts not divisible by ep": ({"num_experts": 6, "parallel": {"expert": 4}}, "moe.parallel.expert",
                                    "got 4", "must divide num_experts (6); valid: 1, 2, 3, 6"),
    "ep above experts": ({"num_experts": 2, "router": "switch", "parallel": {"expert": 4}}, "moe.parallel.expert",
                         "got 4", "valid: 1, 2"),
    "top_k above experts": ({"num_experts": 2, "router": "topk", "top_k": 3}, "moe.top_k", "got 3",
                            "must be at most num_experts (2)"),
    "gshard with top_k 3": (with_experts(router="gshard", top_k=3), "moe.top_k", "got 3",
                            "router 'gshard' routes to exactly 2 experts; use router 'topk'"),
    "switch with top_k 2": (with_experts(router="switch", top_k=2), "moe.top_k", "got 2",
                            "router 'switch' routes to exactly 1 expert"),
    "topk without top_k": (with_experts(router="topk"), "moe.top_k", "missing",
                           "router 'topk' needs top_k: an integer >= 1, at most num_experts (8)"),
    "router misspelt": (with_experts(router="gshrad"), "moe.router", "got 'gshrad'",
                        "expected one of 'gshard', 'switch', 'topk' (did you mean 'gshard'?)"),
    "layers and interval": (with_experts(layers=[0, 2], layer_interval=2), "moe.layers", "got [0, 2]",
                            "set either layers or layer_interval, not both"),
    "negative layer index": (with_experts(layers=[0, -1]), "moe.layers", "got [0, -1]",
                             "layer indices are 0-based and >= 0; -1 is negative"),
    "repeated layer index": (with_experts(layers=[1, 3, 1]), "moe.layers", "got [1, 3, 1]",
                             "repeats 1; list each layer once"),
    "empty layers": (with_experts(layers=[]), "moe.layers", "got []", "expected at least one 0-based layer index"),
    "layer index as string": (with_experts(layers=[1, "3"]), "moe.layers[1]", "got '3'", "expected an integer"),
    "layer interval zero": (with_experts(layer_interval=0), "moe.layer_interval", "got 0",
                            "expected an integer >= 1"),
    "bad placement policy": (with_experts(placement={"policy": "random"}), "moe.placement.policy", "got 'random'",
                             "expected one of 'static', 'greedy', 'network-aware'"),
    "placement window zero": (with_experts(placement={"window": 0}), "moe.placement.window", "got 0",
                              "expected an integer >= 1"),
    "jitter_eps one": (with_experts(jitter_eps=1.0), "moe.jitter_eps", "got 1.0", "expected a number >= 0 and < 1"),
    "jitter_eps above one": (with_experts(jitter_eps=1.5), "moe.jitter_eps", "got 1.5", "and < 1"),
    "aux loss negative": (with_experts(aux_loss_coeff=-0.01), "moe.aux_loss_coeff", "got -0.01",
                          "expected a number >= 0"),
    "activation unknown": (with_experts(activation="silu"), "moe.activation", "got 'silu'",
                           "expected one of 'gelu', 'swiglu', 'relu'"),
    "experts backend unknown": (with_experts(experts_backend="cuda"), "moe.experts_backend", "got 'cuda'",
                                "expected one of 'auto', 'grouped_mm', 'bmm', 'loop'"),
    "sigmoid with gshard": (with_experts(score_function="sigmoid"), "moe.score_function", "got 'sigmoid'",
                            "router 'gshard' is defined on softmax probabilities; sigmoid scores need router 'topk'"),
    "sigmoid with switch": (with_experts(router="switch", score_function="sigmoid"), "moe.score_function",
                            "got 'sigmoid'", "router 'switch' is defined on softmax probabilities"),
    "score function unknown": (with_experts(score_function="tanh"), "moe.score_function", "got 'tanh'",
                               "expected one of 'softmax', 'sigmoid'"),
    "gate_scale zero": (with_experts(gate_scale=0.0), "moe.gate_scale", "got 0.0", "expected a number > 0"),
    "gate_scale negative": (with_experts(gate_scale=-2.5), "moe.gate_scale", "got -2.5", "expected a number > 0"),
    "drop policy unknown": (with_experts(drop_policy="probs"), "moe.drop_policy", "got 'probs'",
                            "expected one of 'position', 'probability'"),
    "aux loss scope unknown": (with_experts(aux_loss_scope="batch"), "moe.aux_loss_scope", "got 'batch'",
                               "expected one of 'micro_batch', 'sequence', 'global'"),
    "aux loss scope without the loss": (with_experts(aux_loss_scope="global", aux_loss_coeff=0.0),
                                        "moe.aux_loss_scope", "got 'global'",
                                        "the balance loss is off (aux_loss_coeff 0): set aux_loss_coeff > 0"),
    "router_groups not dividing": (with_experts(router_groups=3, group_topk=1), "moe.router_groups", "got 3",
                                   "must divide num_experts (8); valid: 2, 4 (the divisors of num_experts 8 but "
                                   "1 and 8)"),
    "router_groups alone": (with_experts(router_groups=4), "moe.router_groups", "got 4",
                            "has no effect without group_topk"),
    # a model constant: never the expert-parallel size, which would make the model depend on the layout
    **{f"group_topk without router_groups at ep{ep}": (
        with_experts(group_topk=1, parallel={"expert": ep}), "moe.router_groups", "missing",
        "group_topk (1) needs router_groups, the number of expert groups (a model constant, the same under every "
        "layout); valid: 2, 4") for ep in (1, 2)},
    "router_groups of prime experts": ({"num_experts": 7, "group_topk": 1}, "moe.router_groups", "missing",
                                       "num_experts 7 has no divisor but 1 and 7, so its experts cannot be grouped"),
    "router_groups one": (with_experts(router_groups=1, group_topk=1), "moe.router_groups", "got 1",
                          "one group holds every expert, so group_topk limits nothing; valid: 2, 4"),
    "router_groups of single experts": (with_experts(router_groups=8, group_topk=2), "moe.router_groups", "got 8",
                                        "groups of one expert limit nothing (the best group_topk >= top_k (2) "
                                        "groups hold a token's best experts)"),
    "group_topk above groups": (with_experts(router_groups=4, group_topk=5), "moe.group_topk", "got 5",
                                "must be less than router_groups (4)"),
    "group_topk all groups": (with_experts(router_groups=2, group_topk=2), "moe.group_topk", "got 2",
                              "must be less than router_groups (2): 2 of 2 groups keep every expert, so nothing is "
                              "limited; valid: 1 to 1"),
    "group_topk too few experts": (with_experts(router="topk", top_k=3, router_groups=4, group_topk=1),
                                   "moe.group_topk", "got 1", "its groups hold 1 x 2 experts, fewer than top_k (3); "
                                   "with router_groups (4) of num_experts 8 it must be at least 2"),
    "group_topk zero": (with_experts(group_topk=0), "moe.group_topk", "got 0", "expected an integer >= 1"),
    "shared gate without expert": (with_experts(shared_expert_gate=True), "moe.shared_expert_gate", "got True",
                                   "set shared_expert_ffn_hidden_size > 0 or shared_expert_gate false"),
    # a value the other settings never read is refused (non-default values only: REFUSED_WHEN_IGNORED)
    "unnormalised gshard": (with_experts(normalize_gates=False), "moe.normalize_gates", "got False",
                            "router 'gshard' always renormalises its two gates, so it has no effect; use router "
                            "'topk' or leave normalize_gates out"),
    "unnormalised switch": (with_experts(router="switch", normalize_gates=False), "moe.normalize_gates",
                            "got False", "router 'switch' never renormalises (its one gate is the softmax "
                            "probability), so it has no effect"),
    **{f"second expert policy with {router}": (
        with_experts(router=router, top_k=k, second_expert_policy="all"), "moe.second_expert_policy", "got 'all'",
        f"only router 'gshard' has a second expert to keep at random (router is {router!r})")
       for router, k in (("switch", 1), ("topk", 2))},
    **{f"dropless with {key}": (with_experts(drop_tokens=False, **{key: value}), f"moe.{key}", f"got {value!r}",
                                "drop_tokens is false (dropless: no capacity, nothing dropped), so it has no effect; "
                                f"set drop_tokens true or leave {key} out")
       for key, value in (("capacity_factor", 1.0), ("eval_capacity_factor", 1.0), ("min_capacity", 0),
                          ("drop_policy", "probability"))},
    "overlap without ep": (with_experts(overlap_chunks=2), "moe.overlap_chunks", "got 2",
                           "there is no expert-parallel exchange to overlap (parallel.expert 1); set "
                           "parallel.expert > 1 or overlap_chunks 1"),
    **{f"placement {policy} without ep": (with_experts(placement={"policy": policy}), "moe.placement.policy",
                                          f"got {policy!r}", "with parallel.expert 1 every rank holds every expert: "
                                          "there is nothing to place")
       for policy in ("greedy", "network-aware")},
    **{f"static placement with {key}": (with_experts(placement={key: value}), f"moe.placement.{key}",
                                        f"got {value!r}", "policy 'static' with replica_budget 0 never checks the "
                                        f"load, so it has no effect; set policy 'greedy' or 'network-aware' (or "
                                        f"replica_budget > 0), or leave {key} out")
       for key, value in (("check_interval", 10), ("window", 10), ("min_gain", 0.0), ("gpus_per_node", 8))},
    "slack with greedy": (with_experts(parallel={"expert": 2}, placement={"policy": "greedy", "slack": 0.2}),
                          "moe.placement.slack", "got 0.2", "only policy 'network-aware' reads it (policy is "
                          "'greedy'); set policy 'network-aware' or leave slack out"),
    "sequence parallel without tp": (with_experts(parallel={"sequence_parallel": True}),
                                     "moe.parallel.sequence_parallel", "got True",
                                     "splits tokens across the tensor-parallel ranks, and tensor is 1"),
    "block not an object": ([8], "moe", "got [8]", "expected a JSON object with at least num_experts"),
    "exchange unknown": (with_experts(exchange="dense"), "moe.exchange", "got 'dense'",
                         "expected one of 'auto', 'counts', 'padded', 'token'"),
    **{f"padded exchange {why}": (with_experts(exchange="padded", parallel={"expert": 2}, **fields), "moe.exchange",
                                  "got 'padded'", valid)
       for why, fields, valid in (
           ("dropless", dict(drop_tokens=False), "needs drop_tokens true"),
           ("with overlap", dict(overlap_chunks=2), "needs overlap_chunks 1 (got 2)"),
           ("with shadows", dict(placement={"replica_budget": 1}), "needs placement.replica_budget 0 (got 1)"),
           ("with greedy", dict(placement={"policy": "greedy"}), "needs placement.policy 'static' (got 'greedy')"),
           ("with traces", dict(placement={"trace_file": "t.npz"}), "needs no placement.trace_file"))},
    "padded exchange without ep": (with_experts(exchange="padded"), "moe.exchange", "got 'padded'",
                                   "needs parallel.expert > 1; use 'counts' or 'auto'"),
    "padded exchange with etp": (with_experts(exchange="padded", parallel={"expert": 2, "expert_tensor": 2}),
                                 "moe.exchange", "got 'padded'", "needs parallel.expert_tensor 1 (got 2)"),
    **{f"token exchange {why}": (with_experts(exchange="token", **fields), "moe.exchange", "got 'token'", valid)
       for why, fields, valid in (
           ("without ep", {}, "needs parallel.expert > 1; use 'counts'"),
           ("with etp", dict(parallel={"expert": 2, "expert_tensor": 2}), "needs parallel.expert_tensor 1 (got 2)"),
           ("with overlap", dict(parallel={"expert": 2}, overlap_chunks=2), "needs overlap_chunks 1 (got 2)"),
           ("with shadows", dict(parallel={"expert": 2}, placement={"replica_budget": 1}),
            "needs placement.replica_budget 0 (got 1): no shadow experts"),
           ("with greedy", dict(parallel={"expert": 2}, placement={"policy": "greedy"}),
            "needs placement.policy 'static' (got 'greedy')"))},
}


@pytest.mark.parametrize("block, path, got, valid", MALFORMED_BLOCKS.values(), ids=MALFORMED_BLOCKS.keys())
def test_malformed_block_names_path_value_and_valid(block, path, got, valid):
    with pytest.raises(ConfigError, match=message(path, got, valid)) as caught:
        MoEConfig.from_dict(block)
    assert "\n" not in str(caught.value)
    assert caught.value.path == path


# (parallel block, world size, key path, how the value is shown, a piece of what is valid)
MALFORMED_SIZES = {
    "world not divisible by tp*pp": ({"tensor": 4, "pipeline": 2}, 12, "moe.parallel.tensor", "got 4",
                                     "must divide the 6 ranks of a pipeline stage (world size 12 / pipeline 2); "
                                     "valid: 1, 2, 3, 6"),
    "world not divisible by pp": ({"pipeline": 4}, 6, "moe.parallel.pipeline", "got 4",
                                  "must divide the world size 6; valid: 1, 2, 3, 6"),
    "ep*etp not dividing a stage": ({"pipeline": 2, "expert": 4, "expert_tensor": 1}, 12, "moe.parallel.expert",
                                    "got 4", "expert x expert_tensor (4 x 1) must divide the 6 ranks of a pipeline "
                                    "stage (world size 12 / pipeline 2); valid with expert_tensor 1: 1, 2, 3, 6"),
    "etp not dividing a stage": ({"tensor": 1, "expert_tensor": 4}, 6, "moe.parallel.expert_tensor", "got 4",
                                 "must divide the 6 ranks of a pipeline stage"),
    "order not ending in pp": ({"pipeline": 2, "expert": 2, "order": "tp-pp-ep-dp"}, 8, "moe.parallel.order",
                               "got 'tp-pp-ep-dp'", "with pipeline > 1 the order must end in 'pp' (e.g. "
                               "'tp-cp-ep-dp-pp') unless the expert data-parallel size (2) equals the "
                               "data-parallel size (4)"),
    "pipeline stages differ between grids": ({"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1,
                                              "order": "tp-pp-dp-ep"}, 8, "moe.parallel.order", "got 'tp-pp-dp-ep'",
                                             "puts pipeline stages 2 ranks apart in attention (tp 2, dp 2) but 1 "
                                             "apart in the experts (etp 1, ep 2, edp 2)"),
    "world size zero": ({}, 0, "world_size", "got 0", "expected a positive integer"),
}


@pytest.mark.parametrize("parallel, world_size, path, got, valid", MALFORMED_SIZES.values(),
                         ids=MALFORMED_SIZES.keys())
def test_sizes_that_do_not_fit_the_world(parallel, world_size, path, got, valid):
    config = MoEConfig.from_dict(with_experts(parallel=parallel))  # valid on its own
    with pytest.raises(ConfigError, match=message(path, got, valid)):
        config.check_world_size(world_size)


def test_order_without_pp_at_the_end_is_fine_when_edp_equals_dp():
    sizes = MoEConfig.from_dict(with_experts(parallel={"pipeline": 2, "order": "tp-pp-ep-dp"})).check_world_size(4)
    assert (sizes.dp, sizes.edp) == (2, 2)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return path


def test_top_level_list_is_not_a_config():
    with pytest.raises(ConfigError, match=message("DeepSpeed config", "got [1, 2]",
                                                  "expected a JSON object at the top level")):
        MoEConfig.from_ds_config([1, 2])


def test_file_holding_a_json_string_is_not_a_config(tmp_path):
    path = write(tmp_path, '"moe"')
    with pytest.raises(ConfigError, match=message(f"DeepSpeed config {path}", "got 'moe'",
                                                  "expected a JSON object at the top level")):
        MoEConfig.from_ds_config(path)


def test_file_that_is_not_json_names_line_and_column(tmp_path):
    path = write(tmp_path, '{"moe": {"num_experts": 8]}')
    expected = f"DeepSpeed config {path}: got invalid JSON at line 1 column 26 (Found ']' where a key name"
    with pytest.raises(ConfigError, match="^" + re.escape(expected) + ".*; expected a JSON object$"):
        MoEConfig.from_ds_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=message("config file", f"got {str(path)!r}", "cannot be read (No such "
                                                  "file or directory); expected the path of a DeepSpeed JSON file")):
        MoEConfig.from_ds_config(str(path))


def test_config_without_moe_block_lists_its_keys():
    with pytest.raises(ConfigError, match=message("moe", "missing", "the DeepSpeed config has no 'moe' block (its "
                                                  "top-level keys: train_batch_size, zero_optimization); add one")):
        MoEConfig.from_ds_config({"train_batch_size": 8, "zero_optimization": {"stage": 1}})


@pytest.mark.parametrize("misspelt", ["Moe", "MOE", "mow", "moe "])
def test_misspelt_moe_block_gets_a_clean_hint(misspelt):
    ds_config = {"train_batch_size": 8, misspelt: {"num_experts": 8}}
    with pytest.raises(ConfigError, match=message("moe", "missing", f"found key {misspelt!r} instead (did you mean "
                                                  "'moe'?); the block key is exactly 'moe', lower case")):
        MoEConfig.from_ds_config(ds_config)


def test_errors_inside_a_file_keep_the_key_path(tmp_path):
    path = write(tmp_path, json.dumps({"moe": {"num_experts": 8, "parallel": {"expret": 2}}}))
    with pytest.raises(ConfigError, match=message("moe.parallel.expret", "got 2", "(did you mean 'expert'?)")):
        MoEConfig.from_ds_config(path)


# -- valid configs ---------------------------------------------------------------------------

# The resolved defaults of the smallest valid block, {"num_experts": 8}; docs/config.md says why.
DEFAULTS = {
    "num_experts": 8, "top_k": 2, "router": "gshard", "normalize_gates": True, "score_function": "softmax",
    "expert_bias_on": None, "gate_scale": 1.0, "group_topk": None, "router_groups": None, "group_score": "top2_sum",
    "second_expert_policy": "random",
    "drop_policy": "position",
    "capacity_factor": 1.25, "eval_capacity_factor": 2.0, "min_capacity": 4, "drop_tokens": True,
    "aux_loss_coeff": 0.01, "aux_loss_scope": "micro_batch", "z_loss_coeff": 0.0, "bias_update_rate": 0.0,
    "jitter_eps": 0.0,
    "layer_interval": 1, "layers": None, "ffn_hidden_size": None, "activation": "gelu",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "expert_linear_bias": False, "router_logit_bias": False,
    "recompute_fc1": False, "experts_backend": "auto", "overlap_chunks": 1, "exchange": "counts",
    "shared_expert_ffn_hidden_size": 0,
    "shared_expert_gate": False,
    "memory_check": True,
    "parallel": {"tensor": 1, "pipeline": 1, "expert": 1, "expert_tensor": 1, "order": "tp-cp-ep-dp-pp",
                 "sequence_parallel": False},
    "placement": {"policy": "static", "check_interval": 100, "window": 100, "min_gain": 0.05, "replica_budget": 0,
                  "slack": 0.1, "gpus_per_node": None, "trace_file": None},
}


def test_defaults_resolve():
    config = MoEConfig.from_dict({"num_experts": 8})
    assert config.resolved_dict() == DEFAULTS
    assert config.k == 2 and config.top_k is None  # top_k follows the router until set


@pytest.mark.parametrize("router, k", [("gshard", 2), ("switch", 1)])
def test_top_k_default_follows_the_router(router, k):
    assert MoEConfig.from_dict(with_experts(router=router)).k == k


def test_router_groups_never_follow_the_layout():
    assert MoEConfig.from_dict(with_experts()).group_limit is None
    for ep in (1, 2, 4, 8):
        config = MoEConfig.from_dict(with_experts(group_topk=1, router_groups=4, parallel={"expert": ep}))
        assert config.group_limit == (4, 1, 2)
    wide = with_experts(num_experts=16, router="topk", top_k=4, group_topk=2, router_groups=8)
    assert MoEConfig.from_dict(dict(wide, parallel={"expert": 2})).group_limit == (8, 2, 2)


# Settings under which a field is never read, and a value of it for each (valid but ignored there).
REFUSED_WHEN_IGNORED = {
    "normalize_gates": (dict(router="gshard"), False),
    "second_expert_policy": (dict(router="topk", top_k=2), "all"),
    "capacity_factor": (dict(drop_tokens=False), 2.0),
    "eval_capacity_factor": (dict(drop_tokens=False), 1.0),
    "min_capacity": (dict(drop_tokens=False), 0),
    "drop_policy": (dict(drop_tokens=False), "probability"),
    "overlap_chunks": ({}, 2),
    "swiglu_alpha": (dict(activation="swiglu"), 1.0),
    "swiglu_limit": ({}, 5.0),
    "placement.check_interval": ({}, 10),
    "placement.window": ({}, 10),
    "placement.min_gain": ({}, 0.0),
    "placement.gpus_per_node": ({}, 8),
    "placement.slack": (dict(parallel={"expert": 2}, placement={"policy": "greedy"}), 0.3),
}


def _with(block: dict, key: str, value) -> dict:
    block = json.loads(json.dumps(block))
    if key.startswith("placement."):
        block.setdefault("placement", {})[key.split(".")[1]] = value
    else:
        block[key] = value
    return block


@pytest.mark.parametrize("key", REFUSED_WHEN_IGNORED)
def test_an_ignored_field_is_refused_only_when_it_differs_from_its_default(key):
    settings, value = REFUSED_WHEN_IGNORED[key]
    with pytest.raises(ConfigError, match=message(f"moe.{key}", f"got {value!r}", "")):
        MoEConfig.from_dict(_with(with_experts(**settings), key, value))
    model, name = (PlacementConfig, key.split(".")[1]) if key.startswith("placement.") else (MoEConfig, key)
    default = model.model_fields[name].default
    written = MoEConfig.from_dict(_with(with_experts(**settings), key, default))   # the default written out
    assert written == MoEConfig.from_dict(with_experts(**settings))


def test_layers_with_the_default_interval_written_out():
    assert MoEConfig.from_dict(with_experts(layers=[1], layer_interval=1)).layers == [1]


@pytest.mark.parametrize("block, backend, mode", [
    ({}, "gloo", "padded"),
    ({}, "nccl", "counts"),                                     # the counts round is cheap there
    ({"drop_tokens": False}, "gloo", "counts"),                 # no capacity bounds the rows
    ({"overlap_chunks": 2}, "gloo", "counts"),
    ({"placement": {"replica_budget": 1}}, "gloo", "counts"),
    ({"placement": {"policy": "network-aware"}}, "gloo", "counts"),
    ({"exchange": "counts"}, "gloo", "counts"),
    ({"exchange": "padded"}, "nccl", "padded"),
    ({"exchange": "token"}, "gloo", "token"),                   # named only, never chosen by auto
])
def test_exchange_auto_resolves_by_config_and_backend(block, backend, mode, monkeypatch):
    import torch.distributed as dist

    from moe_plugin.layers.exchange_factory import resolve_exchange
    from moe_plugin.layers.parallel import LayerParallelism

    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    config = MoEConfig.from_dict({"num_experts": 8, "parallel": {"expert": 2}, "exchange": "auto", **block})
    assert resolve_exchange(config, LayerParallelism(ep=object(), ep_size=2)) == mode
    assert resolve_exchange(config.model_copy(update={"exchange": "auto"}), LayerParallelism()) == "counts"  # no EP


def test_padded_header_digits_are_exact_in_the_dtype():
    import torch

    from moe_plugin.layers.padded_wire import header_digits

    assert header_digits(torch.float32, 2 ** 24 - 1) == (2 ** 24, 1)
    assert header_digits(torch.bfloat16, 255) == (256, 1) and header_digits(torch.bfloat16, 256) == (256, 2)
    assert header_digits(torch.float16, 3000) == (2048, 2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base, _ = header_digits(dtype, 1)
        values = torch.arange(base)
        assert torch.equal(values.to(dtype).long(), values), dtype


def test_expert_tensor_defaults_to_tensor():
    config = MoEConfig.from_dict(with_experts(parallel={"tensor": 4}))
    assert config.parallel.expert_tensor is None and config.parallel.etp == 4


def test_from_ds_config_dict_and_path_agree(tmp_path):
    ds_config = {"train_batch_size": 8, "moe": {"num_experts": 16, "router": "topk", "top_k": 4}}
    from_dict = MoEConfig.from_ds_config(ds_config)
    from_path = MoEConfig.from_ds_config(write(tmp_path, json.dumps(ds_config)))
    assert from_dict == from_path
    assert (from_dict.num_experts, from_dict.k) == (16, 4)


def test_example_4rank_config_is_ep2_by_edp2():
    config = MoEConfig.from_ds_config(EXAMPLE_4RANK)
    assert (config.num_experts, config.router, config.k) == (8, "gshard", 2)
    sizes = config.check_world_size(4)
    assert (sizes.tp, sizes.pp, sizes.dp, sizes.ep, sizes.etp, sizes.edp) == (1, 1, 4, 2, 1, 2)


@pytest.mark.parametrize("parallel, world_size, dp, edp", [
    ({}, 1, 1, 1),
    ({"expert": 2}, 4, 4, 2),
    ({"tensor": 2, "expert": 2}, 4, 2, 1),                        # etp = tp = 2: ep from dp
    ({"tensor": 2, "expert": 2, "expert_tensor": 1}, 4, 2, 2),     # folded: ep carved out of tp
    ({"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 16, 4, 4),
    ({"tensor": 8, "pipeline": 4, "expert": 8, "expert_tensor": 1}, 1024, 32, 32),
])
def test_check_world_size_gives_dp_and_edp(parallel, world_size, dp, edp):
    sizes = MoEConfig.from_dict(with_experts(parallel=parallel)).check_world_size(world_size)
    assert isinstance(sizes, ParallelSizes)
    assert (sizes.world_size, sizes.dp, sizes.edp) == (world_size, dp, edp)
    assert sizes.tp * sizes.dp * sizes.pp == world_size == sizes.etp * sizes.ep * sizes.edp * sizes.pp


def test_is_moe_layer_by_interval():
    config = MoEConfig.from_dict(with_experts(layer_interval=3))
    assert [i for i in range(10) if config.is_moe_layer(i)] == [0, 3, 6, 9]


def test_is_moe_layer_by_list():
    config = MoEConfig.from_dict(with_experts(layers=[1, 4]))
    assert [i for i in range(6) if config.is_moe_layer(i)] == [1, 4]


def test_every_layer_is_moe_by_default():
    config = MoEConfig.from_dict({"num_experts": 8})
    assert all(config.is_moe_layer(i) for i in range(5))


def test_config_code_never_imports_torch():
    # Errors must come before any process group exists: the config package cannot even reach one.
    for source in (REPO / "moe_plugin" / "configs").glob("*.py"):
        tree = ast.parse(source.read_text())
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "torch"], source.name


# -- docs/config.md --------------------------------------------------------------------------

def test_docs_config_md_is_up_to_date():
    written = (REPO / "docs" / "config.md").read_text()
    assert written == render_markdown(written), ("docs/config.md is stale: "
                                                 "python -m moe_plugin_tools.config_docs")


def test_docs_list_every_field_and_the_formulas():
    text = render_markdown()
    for model in (MoEConfig, ParallelConfig, PlacementConfig):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name
    assert "capacity = max(min_capacity, ceil(capacity_factor * k * T / E))" in text
    assert "balance = E * sum_e f_e * p_e" in text


def test_docs_full_example_is_valid_and_complete():
    block = full_example()["moe"]
    assert MoEConfig.from_dict(block).resolved_dict() == block
    assert set(block) == set(MoEConfig.model_fields)


def test_config_error_survives_pickling():
    # A ConfigError raised on one rank must reach the launching process intact.
    import pickle

    for block in ({"num_experts": 8, "parallel": {"expert": 3}}, {}):
        with pytest.raises(ConfigError) as info:
            MoEConfig.from_dict(block)
        again = pickle.loads(pickle.dumps(info.value))
        assert type(again) is ConfigError and str(again) == str(info.value)


@pytest.mark.parametrize("how", [dict(overlap_chunks=2, placement={"policy": "greedy", "check_interval": 10}),
                                 dict(exchange="token", placement={"replica_budget": 0, "trace_file": "g.trace"}),
                                 dict(exchange="padded"), dict(placement={"replica_budget": 2, "window": 5})])
def test_an_export_config_of_any_layout_validates_on_one_rank(how):
    from moe_plugin.checkpoint.export import export_config, exported_moe_config

    block = with_experts(router="topk", top_k=2, group_topk=1, router_groups=4, **how,
                         parallel={"tensor": 2, "expert": 2, "expert_tensor": 1, "sequence_parallel": True})
    source = MoEConfig.from_dict(block)
    meta = {"model": {"transformer_config": {}, "vocab_size": 32, "max_sequence_length": 8}, "moe":
            source.resolved_dict(), "tag": "t", "global_steps": 1, "layout": {}, "zero_stage": 1}
    one = exported_moe_config(export_config(meta, "ckpt"))
    assert (one.parallel.expert, one.overlap_chunks, one.exchange, one.placement) == (1, 1, "counts", PlacementConfig())
    assert one.group_limit == source.group_limit and one.k == source.k
