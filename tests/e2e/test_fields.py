"""Every field of the ``"moe"`` block and every model flag of the example does what it says, through
the example (``examples/gpt_moe/pretrain_gpt_moe.py``, its ``main`` on gloo ranks as the launcher
would start it).

The cases are a table, ``CASES``: one or more per field of ``MoEConfig`` (walked recursively,
``parallel`` and ``placement`` included) and per flag of the example's model group. A case is a
value, run for 3 steps and one validation on 2 ranks (dp 2 x ep 2) and compared with its reference
run (the default block ``BASE``, or a stated variant of it) on the same seed:

* ``CHANGES``: a field that changes the model's function or its training (router, capacity, losses,
  activation, sizes, ...) must move some training or validation loss by more than ``CHANGED``;
* ``EQUAL``: a field that only changes how the work is done (backend, exchange, overlap,
  recompute, placement, the layout itself) must leave every loss equal (``TOL``);
* ``not_run``: why the value cannot run here (a non-empty string; the case is skipped).

``test_every_field_and_model_flag_has_a_case`` fails when a field or a model flag has no case (a new
field needs one), when a case names something that does not exist, or when an argument group of the
example is not classified. The same runs, where the schema accepts the value there, go on 1 rank
and on 4 ranks (ep 4): ``test_same_losses_under_every_layout`` asks for the 2-rank losses at 1e-5
(no field may make the model depend on the layout), except where ``one_layout`` says why not.

Findings the table holds (by design today, each case says so): GShard's random routing and the
jitter draw per data-parallel replica, as dropout does, so those values are not compared across
layouts. (The TP ranks of a replica route its micro-batch as one group, as one rank does: the
``parallel.tensor`` and ``parallel.sequence_parallel`` cases at the default capacity and balance
loss hold that.)

Cost: every run of a world size shares one spawn (the example's ``main`` called once per run in
the same ranks), so a run is the engine's set-up and 3 steps; ``test_repeated_main_leaks_nothing``
checks that the reference run, repeated at the end of a spawn, gives its first losses to the bit.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
from pydantic import BaseModel

from dist import attempts, run_distributed
from ds_json import ds_config
from example_runs import example_script

from moe_plugin.configs import ConfigError, MoEConfig

CHANGES, EQUAL = "changes", "equal"
TOL = 1e-5        # relative, every loss: equal at one layout, and across layouts (seen: 0 to 2e-7)
CHANGED = 1e-5    # relative, the largest loss difference a CHANGES case must exceed (seen: 3e-5 and more)
STEPS, BATCH, MICRO = 3, 8, 2
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
         "--seq-length", "32", "--train-iters", str(STEPS), "--eval-interval", "0", "--eval-iters", "1",
         "--log-interval", str(STEPS), "--seed", "7", "--corpus-bytes", str(192 * 1024), "--valid-fraction", "0.25",
         "--distributed-timeout-minutes", "3", "--no-plot"]
# The reference block: deterministic top-2 (GShard's random routing draws its numbers per rank: see
# its case); every other field at the schema's default.
BASE = {"num_experts": 4, "router": "topk", "top_k": 2}
LAYOUTS = {"ep2": (2, {"expert": 2}), "one": (1, {}), "ep4": (4, {"expert": 4})}   # the first is the main one
MAIN = "ep2"
NOISE = ("the router's noise generator is seeded per data-parallel replica (its index in dp), so its draws "
         "follow the layout")
DROPOUT = "dropout draws from each rank's torch generator, so its masks follow the layout"
A_LAYOUT = "the value is itself a layout of the reference model: its case compares it with the ep2 run"
SKEW = ("--router-skew", "4.0")   # placement cases: a skewed load, so that greedy placement moves experts
GREEDY = {"policy": "greedy", "check_interval": 1, "min_gain": 0.0}
TP_SAFE = {"drop_tokens": False, "aux_loss_scope": "sequence"}   # a second TP comparison
MOVED = r"[1-9]\d* switch"   # the progress line of a placement that moved experts
NETWORK = {"policy": "network-aware", "check_interval": 1, "min_gain": 0.0, "gpus_per_node": 1}
ROPE = ("--position-embedding-type", "rope")
MLA = ROPE + ("--multi-latent-attention",)   # multi-latent attention's sizes: each changes the model


@dataclass(frozen=True)
class Case:
    """``value``: ``moe`` keys over ``BASE`` (a nested ``parallel`` replaces the layout's);
    ``flags``: the example's flags; ``ref`` / ``ref_flags``: what the reference run adds to ``BASE``
    (``value`` and ``flags`` go on top of them); ``gas1``: one micro-batch per rank (the micro-batch
    is the global batch over the data-parallel size) in the case and its reference; ``world``: the
    ranks of a layout case; ``shows``: a pattern the placement part of the last progress line must
    match at the main layout (that experts moved, were shadowed, traced: not a vacuous EQUAL)."""

    field: str
    expect: str = CHANGES
    value: Optional[dict] = None
    flags: tuple = ()
    ref: Optional[dict] = None
    ref_flags: tuple = ()
    not_run: str = ""
    one_layout: str = ""
    gas1: bool = False
    world: int = 2
    shows: str = ""
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.field.startswith("--"):
            return " ".join(self.flags)
        value = self.value
        for part in self.field.split("."):
            value = value.get(part, {}) if isinstance(value, dict) else {}
        return f"{self.field}={json.dumps(value) if value != {} else _short(self.value, ())}"

    def moe(self, parallel: dict, reference: bool = False) -> dict:
        block = {**BASE, "parallel": parallel}
        for over in ([self.ref or {}] if reference else [self.ref or {}, self.value or {}]):
            for key, val in over.items():
                block[key] = {**block.get(key, {}), **val} if key == "placement" else val
        return {k: v for k, v in block.items() if v is not None}

    def argv(self, reference: bool = False) -> tuple:
        return tuple(self.ref_flags) if reference else (*self.ref_flags, *self.flags)


def _short(value: Optional[dict], flags: tuple) -> str:
    text = json.dumps(value, separators=(",", ":"))[1:-1] if value else ""
    return (text + " " + " ".join(flags)).strip().replace('"', "")


CASES = [
    # --- the router
    Case("num_experts", value={"num_experts": 8}),
    Case("top_k", value={"top_k": 3}),
    Case("router", value={"router": "gshard", "top_k": None}, one_layout=NOISE),   # random routing: see below
    Case("router", value={"router": "switch", "top_k": None}),
    Case("normalize_gates", value={"normalize_gates": False}),
    Case("score_function", value={"score_function": "sigmoid"}),
    Case("gate_scale", value={"gate_scale": 2.5}),
    Case("expert_bias_on", value={"expert_bias_on": "scores"},   # the bias moves after step 1, then chooses
         ref={"bias_update_rate": 0.1, "aux_loss_coeff": 0.0}),    # on probabilities instead of logits
    Case("group_topk", value={"group_topk": 1, "router_groups": 2}),
    Case("router_groups", value={"router_groups": 4}, ref={"num_experts": 8, "group_topk": 1, "router_groups": 2}),
    Case("group_score", value={"group_score": "max"}, ref={"group_topk": 1, "router_groups": 2}),
    # (gshard with "all" is the reference's top-2 to the bit)
    Case("second_expert_policy", value={"second_expert_policy": "all"}, ref={"router": "gshard", "top_k": None}),
    Case("jitter_eps", value={"jitter_eps": 0.3}, one_layout=NOISE),
    # --- capacity
    Case("capacity_factor", value={"capacity_factor": 0.5}),
    Case("eval_capacity_factor", value={"eval_capacity_factor": 0.5}),   # the validation loss
    Case("min_capacity", value={"min_capacity": 48}, ref={"capacity_factor": 0.5}),
    Case("drop_tokens", value={"drop_tokens": False}),
    Case("drop_policy", value={"drop_policy": "probability"}),
    # --- losses and balancing
    Case("aux_loss_coeff", value={"aux_loss_coeff": 1.0}),
    Case("aux_loss_scope", value={"aux_loss_scope": "sequence"}, ref={"aux_loss_coeff": 1.0}),
    # global: a step's loads over every rank and micro-batch so far, so the layouts are compared with
    # one micro-batch per rank (docs/config.md, aux_loss_scope: "with one micro-batch per rank ...
    # whatever the layout"), and dropless, as the micro-batch then differs in size
    Case("aux_loss_scope", value={"aux_loss_scope": "global"}, ref={"aux_loss_coeff": 1.0, "drop_tokens": False},
         gas1=True),
    Case("z_loss_coeff", value={"z_loss_coeff": 0.1}),
    Case("bias_update_rate", value={"bias_update_rate": 0.1}, ref={"aux_loss_coeff": 0.0}),
    # --- which layers, the experts
    Case("layer_interval", value={"layer_interval": 2}),
    Case("layers", value={"layers": [1]}),
    Case("ffn_hidden_size", value={"ffn_hidden_size": 32}),
    Case("activation", value={"activation": "swiglu"}),
    Case("activation", value={"activation": "relu"}),
    Case("activation", value={"activation": "clamped_swiglu"}),
    # a clamp that cuts at init (pre-activations of about 0.1) and another gain, against GPT-OSS's own
    Case("swiglu_limit", value={"swiglu_limit": 0.05}, ref={"activation": "clamped_swiglu"}),
    Case("swiglu_alpha", value={"swiglu_alpha": 1.0}, ref={"activation": "clamped_swiglu"}),
    Case("expert_linear_bias", value={"expert_linear_bias": True}),   # zeros at init, trained from step 1
    Case("router_logit_bias", value={"router_logit_bias": True}),
    Case("shared_expert_ffn_hidden_size", value={"shared_expert_ffn_hidden_size": 32}),
    Case("shared_expert_gate", value={"shared_expert_gate": True}, ref={"shared_expert_ffn_hidden_size": 32}),
    Case("memory_check", EQUAL, value={"memory_check": False}),   # the check only decides whether to start
    # --- how the work is done
    Case("recompute_fc1", EQUAL, value={"recompute_fc1": True}),
    Case("experts_backend", EQUAL, value={"experts_backend": "bmm"}),
    Case("experts_backend", EQUAL, value={"experts_backend": "loop"}),
    # 8 experts: 2 per rank at ep4 too (a chunk needs an expert; at ep1 there is no exchange to overlap)
    Case("overlap_chunks", EQUAL, value={"overlap_chunks": 2}, ref={"num_experts": 8}),
    Case("exchange", EQUAL, value={"exchange": "padded"}),
    Case("exchange", EQUAL, value={"exchange": "token"}),
    # --- the layout: the same model
    Case("parallel.expert", EQUAL, value={"parallel": {"expert": 1}}, one_layout=A_LAYOUT),
    # The TP ranks of a replica route its micro-batch as one GShard group (layers/parallel.py 1): the
    # default capacity and micro_batch balance loss are those of one rank (the first case; with sequence
    # parallelism below). The second compares dropless with the per-sequence balance loss.
    Case("parallel.tensor", EQUAL, value={"parallel": {"tensor": 2, "expert": 2, "expert_tensor": 1}},
         one_layout=A_LAYOUT, label="parallel.tensor=2 (default capacity and balance loss)"),
    Case("parallel.tensor", EQUAL, value={"parallel": {"tensor": 2, "expert": 2, "expert_tensor": 1}},
         ref=TP_SAFE, one_layout=A_LAYOUT, label="parallel.tensor=2 (dropless, sequence balance loss)"),
    Case("parallel.expert_tensor", EQUAL, value={"parallel": {"tensor": 2, "expert_tensor": 2}}, ref=TP_SAFE,
         one_layout=A_LAYOUT),
    Case("parallel.pipeline", EQUAL, value={"parallel": {"pipeline": 2}}, one_layout=A_LAYOUT),
    Case("parallel.order", EQUAL, value={"parallel": {"expert": 2, "order": "tp-cp-dp-ep-pp"}}, world=4,
         one_layout=A_LAYOUT),
    Case("parallel.sequence_parallel", EQUAL,
         value={"parallel": {"tensor": 2, "expert": 2, "expert_tensor": 1, "sequence_parallel": True}},
         one_layout=A_LAYOUT),
    # --- placement: experts move, the model stays (against the static run of the same skewed router)
    Case("placement.policy", EQUAL, value={"placement": GREEDY}, ref_flags=SKEW, shows=MOVED),
    Case("placement.policy", EQUAL, value={"placement": {**NETWORK, "policy": "network-aware"}}, ref_flags=SKEW,
         shows=MOVED, label="placement.policy=network-aware"),
    Case("placement.check_interval", EQUAL, value={"placement": {**GREEDY, "check_interval": 2}}, ref_flags=SKEW,
         shows=MOVED),
    Case("placement.window", EQUAL, value={"placement": {**GREEDY, "window": 1}}, ref_flags=SKEW, shows=MOVED),
    Case("placement.min_gain", EQUAL, value={"placement": {**GREEDY, "min_gain": 0.0}}, ref_flags=SKEW, shows=MOVED,
         label="placement.min_gain=0.0"),
    Case("placement.slack", EQUAL, value={"placement": {**NETWORK, "slack": 0.5}}, ref_flags=SKEW, shows=MOVED),
    Case("placement.gpus_per_node", EQUAL, value={"placement": {**NETWORK, "gpus_per_node": 2}}, ref_flags=SKEW),
    Case("placement.replica_budget", EQUAL, value={"placement": {"replica_budget": 2, "check_interval": 1}},
         ref_flags=SKEW, shows=r"\([1-9]\d* shadowed"),
    Case("placement.trace_file", EQUAL, value={"placement": {"trace_file": "gate_trace.jsonl"}}, ref_flags=SKEW,
         shows="tracing"),
    # --- the example's model flags (and the two training flags that change the model)
    Case("--num-layers", flags=("--num-layers", "3")),
    Case("--hidden-size", flags=("--hidden-size", "64")),
    Case("--num-attention-heads", flags=("--num-attention-heads", "4")),
    Case("--ffn-hidden-size", flags=("--ffn-hidden-size", "128")),
    Case("--seq-length", flags=("--seq-length", "16")),
    Case("--max-position-embeddings", flags=("--max-position-embeddings", "64")),
    Case("--init-method-std", flags=("--init-method-std", "0.01")),
    Case("--hidden-dropout", flags=("--hidden-dropout", "0.1"), one_layout=DROPOUT),
    Case("--attention-dropout", flags=("--attention-dropout", "0.1"), one_layout=DROPOUT),
    Case("--untie-embeddings-and-output-weights", flags=("--untie-embeddings-and-output-weights",)),
    Case("--disable-bias-linear", flags=("--disable-bias-linear",)),
    Case("--dense", flags=("--dense",)),
    Case("--normalization", flags=("--normalization", "RMSNorm")),
    Case("--norm-epsilon", flags=("--norm-epsilon", "0.1")),
    Case("--position-embedding-type", flags=("--position-embedding-type", "rope")),
    Case("--rotary-base", flags=("--rotary-base", "100"), ref_flags=("--position-embedding-type", "rope")),
    Case("--rotary-percent", flags=("--rotary-percent", "0.5"), ref_flags=("--position-embedding-type", "rope")),
    Case("--rope-scaling", flags=("--rope-scaling", '{"rope_type": "yarn", "factor": 4, '
                                  '"original_max_position_embeddings": 8}'),
         ref_flags=("--position-embedding-type", "rope")),
    Case("--swiglu", flags=("--swiglu",), ref={"layer_interval": 2}),   # a dense MLP to gate (layer 1)
    Case("--group-query-attention", flags=("--group-query-attention",), label="--group-query-attention (1 group)"),
    Case("--num-query-groups", flags=("--num-query-groups", "2"), ref_flags=("--group-query-attention",)),
    Case("--qk-layernorm", flags=("--qk-layernorm",)),
    Case("--qk-layernorm-scope", flags=("--qk-layernorm-scope", "projection"),
         ref_flags=("--qk-layernorm", "--normalization", "RMSNorm")),
    Case("--kv-channels", flags=("--kv-channels", "8")),
    Case("--add-qkv-bias", flags=("--add-qkv-bias",), ref_flags=("--disable-bias-linear",)),
    Case("--window-size", flags=("--window-size", "7,0")),
    Case("--window-attn-skip-freq", flags=("--window-attn-skip-freq", "2"), ref_flags=("--window-size", "7,0")),
    Case("--softmax-type", flags=("--softmax-type", "learnable")),
    Case("--softmax-type", flags=("--softmax-type", "off-by-one")),
    Case("--multi-latent-attention", flags=("--multi-latent-attention",), ref_flags=ROPE),
    Case("--q-lora-rank", flags=("--q-lora-rank", "16"), ref_flags=MLA),
    Case("--kv-lora-rank", flags=("--kv-lora-rank", "8"), ref_flags=MLA),
    Case("--qk-head-dim", flags=("--qk-head-dim", "8"), ref_flags=MLA),
    Case("--qk-pos-emb-head-dim", flags=("--qk-pos-emb-head-dim", "4"), ref_flags=MLA),
    Case("--v-head-dim", flags=("--v-head-dim", "8"), ref_flags=MLA),
    Case("--router-skew", flags=SKEW),
    Case("--freeze-router", flags=("--freeze-router",)),
]
# Flags outside the model group that change the model: they need a case too.
MODEL_FLAGS_ELSEWHERE = ("--router-skew", "--freeze-router")
# The example's argument groups and why their flags need no case (a new group fails the test).
NOT_MODEL_GROUPS = {
    "training": "batch, steps, validation, seed, checkpoints, diagnostics: how long and how the run goes",
    "data": "which tokens are read (the model is the same)",
    "output": "where the metrics go",
    "DeepSpeed": "the DeepSpeed JSON's path: the moe block is the cases' subject",
    "positional arguments": "none", "options": "--help, --local_rank (set by the launcher)",
}
MODEL_GROUP = "model"


# --- the runs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    world: int
    moe: dict
    flags: tuple
    gas1: bool

    @property
    def key(self) -> str:
        text = json.dumps([self.moe, self.flags, self.gas1], sort_keys=True)
        return f"w{self.world}-" + hashlib.sha1(text.encode()).hexdigest()[:10]

    def problem(self) -> Optional[str]:
        """Why the schema refuses this block on ``world`` ranks, or None."""
        try:
            MoEConfig.from_dict(self.moe).check_world_size(self.world)
        except ConfigError as err:
            return str(err)
        return None

    def ds_config(self) -> dict:
        dp = MoEConfig.from_dict(self.moe).check_world_size(self.world).dp
        micro = BATCH // dp if self.gas1 else MICRO
        return ds_config(batch=BATCH, micro=micro, dp=dp, moe=self.moe)


def case_run(case: Case, layout: str, reference: bool = False) -> Run:
    world, parallel = LAYOUTS[layout]
    value_parallel = (case.value or {}).get("parallel")
    if value_parallel is not None and not reference:
        world = case.world
    moe = case.moe(parallel, reference)
    if reference:
        moe["parallel"] = parallel
    return Run(world, moe, case.argv(reference), case.gas1)


def _cross_layouts(case: Case) -> dict[str, Optional[Run]]:
    """The case's run at every other layout, None where the schema refuses the value there."""
    if case.one_layout or case.not_run:
        return {}
    out = {}
    for layout in LAYOUTS:
        if layout != MAIN:
            run = case_run(case, layout)
            out[layout] = None if run.problem() else run
    return out


def planned_runs() -> dict[int, dict[str, Run]]:
    """Every run, by world size, each once; the reference first and again last (the leak check)."""
    runs: dict[int, dict[str, Run]] = {}
    for case in CASES:
        if case.not_run:
            continue
        wanted = [case_run(case, MAIN), case_run(case, MAIN, reference=True),
                  *[r for r in _cross_layouts(case).values() if r is not None]]
        for run in wanted:
            runs.setdefault(run.world, {})[run.key] = run
    for world, layout in ((w, l) for l, (w, _) in LAYOUTS.items()):
        base = Run(world, {**BASE, "parallel": LAYOUTS[layout][1]}, (), False)
        ordered = {base.key: base, **{k: r for k, r in runs.get(world, {}).items() if k != base.key}}
        ordered[base.key + "-again"] = base
        runs[world] = ordered
    return runs


def _ranks(rank: int, world_size: int, runs: dict[str, list]) -> dict:
    """Every run through the example's ``main``, one after another in this process."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    script = example_script()
    results: dict = {}
    attempt = attempts(results, rank)

    def one(argv: list) -> dict:
        out, err = io.StringIO(), io.StringIO()
        began = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = script.main(argv)
        return {"status": status, "s": time.perf_counter() - began, "err": err.getvalue()[-3000:]}

    for name, argv in runs.items():
        attempt(name, one, argv)
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Run key -> {"losses": [train..., valid...], "placement": progress text} or {"error": text}."""
    root = tmp_path_factory.mktemp("fields")
    data = root / "data"
    results: dict[str, dict] = {}
    timing = {}
    for world, runs in sorted(planned_runs().items()):
        argvs = {}
        for name, run in runs.items():
            path = root / f"{name}.json"
            path.write_text(json.dumps(run.ds_config()))
            argvs[name] = [*FLAGS, *run.flags, "--deepspeed_config", str(path), "--run-dir", str(root / "runs" / name),
                           "--data-cache", str(data)]
        began = time.perf_counter()
        per_rank = run_distributed(_ranks, world, root, argvs, timeout=900)
        timing[world] = (len(runs), time.perf_counter() - began)
        for name in runs:
            results[name] = _outcome(root / "runs" / name, [r[name] for r in per_rank])
    print("\nfield runs: " + ", ".join(f"{w} rank(s) {n} runs {s:.0f} s" for w, (n, s) in timing.items()))
    return results


def _outcome(run_dir: Path, ranks: list) -> dict:
    for rank, got in enumerate(ranks):
        if isinstance(got, str):
            return {"error": got}
        if got["status"] != 0:
            return {"error": f"rank {rank}: status {got['status']}: {got['err'].strip()}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and len(valid) == 1, records
    return {"losses": [r["loss"] for r in train + valid], "placement": train[-1].get("placement", ""),
            "s": max(got["s"] for got in ranks)}


def losses(outcomes: dict, run: Run) -> list[float]:
    got = outcomes[run.key]
    if "error" in got:
        pytest.fail(f"{run.world} rank(s), moe {json.dumps(run.moe)} {' '.join(run.flags)}:\n{got['error']}",
                    pytrace=False)
    return got["losses"]


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# --- the tests -----------------------------------------------------------------------------------
def _schema_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _schema_fields(kind, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _example_groups() -> dict[str, list[str]]:
    """The example's argument groups: title -> long option strings (its parser, as parse_args builds it)."""
    seen = {}

    def capture(parser, *args, **kwargs):
        seen["parser"] = parser
        raise SystemExit(0)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(SystemExit):
        example_script().parse_args([])
    return {g.title: [o for a in g._group_actions for o in a.option_strings if o.startswith("--")]
            for g in seen["parser"]._action_groups}


def _resolved(block: dict, field: str):
    value = MoEConfig.from_dict(block).resolved_dict()
    for part in field.split("."):
        value = value[part]
    return value


def test_every_field_and_model_flag_has_a_case():
    fields = set(_schema_fields(MoEConfig))
    groups = _example_groups()
    model = next(flags for title, flags in groups.items() if title.startswith(MODEL_GROUP))
    flags = set(model) | set(MODEL_FLAGS_ELSEWHERE)
    unclassified = [t for t in groups if not t.startswith(MODEL_GROUP)
                    and not any(t.startswith(known) for known in NOT_MODEL_GROUPS)]
    assert not unclassified, f"argument groups of the example without cases or a reason: {unclassified}"
    covered = {c.field for c in CASES}
    assert not fields - covered, f"moe fields without a case in CASES: {sorted(fields - covered)}"
    assert not flags - covered, f"model flags of the example without a case in CASES: {sorted(flags - covered)}"
    assert not covered - fields - flags, f"cases of no field or model flag: {sorted(covered - fields - flags)}"
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names), "two cases have one name: give one a label"
    for case in CASES:
        assert case.expect in (CHANGES, EQUAL), case
        assert isinstance(case.not_run, str) and isinstance(case.one_layout, str), case
        if case.not_run:
            continue
        run, ref = case_run(case, MAIN), case_run(case, MAIN, reference=True)
        assert run.problem() is None, f"{case.name}: the schema refuses the case on {run.world} ranks: {run.problem()}"
        assert ref.problem() is None, f"{case.name}: the schema refuses its reference: {ref.problem()}"
        if case.field.startswith("--"):   # the flag is what differs from the reference
            assert case.field in case.flags and run.moe == ref.moe, case
        elif not case.field.startswith("parallel."):   # the field differs from the reference's
            assert _resolved(run.moe, case.field) != _resolved(ref.moe, case.field), case
        if not case.one_layout:   # compared at least at one other layout than the main one
            assert any(_cross_layouts(case).values()), f"{case.name}: the schema refuses it at every other layout"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_field_value(case, outcomes, field_table):
    if case.not_run:
        assert case.not_run.strip(), case
        pytest.skip(case.not_run)
    run, ref = case_run(case, MAIN), case_run(case, MAIN, reference=True)
    got, want = losses(outcomes, run), losses(outcomes, ref)
    diff = rel_diff(got, want)
    field_table[case.name] = {"expect": case.expect, "diff": diff}
    if case.expect == CHANGES:
        assert diff > CHANGED, (f"{case.name} should change the losses (by more than {CHANGED} relative) but moved "
                                f"them by {diff:.2e}: {got} vs {want}")
    else:
        assert diff <= TOL, f"{case.name} should leave the losses equal but moved them by {diff:.2e}: {got} vs {want}"
    if case.shows:
        text = outcomes[run.key]["placement"]
        assert re.search(case.shows, text), f"{case.name}: the progress line does not show {case.shows!r}: {text!r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.not_run], ids=lambda c: c.name)
def test_same_losses_under_every_layout(case, outcomes, field_table):
    if case.one_layout:
        assert case.one_layout.strip(), case
        pytest.skip(case.one_layout)
    main = losses(outcomes, case_run(case, MAIN))
    compared = {}
    for layout, run in _cross_layouts(case).items():
        if run is None:
            compared[layout] = "refused"
            continue
        got = losses(outcomes, run)
        compared[layout] = rel_diff(got, main)
        assert compared[layout] <= TOL, (f"{case.name}: {layout} gives other losses than {MAIN} "
                                         f"({compared[layout]:.2e} relative): {got} vs {main}")
    field_table.setdefault(case.name, {})["layouts"] = compared


@pytest.mark.slow
def test_repeated_main_leaks_nothing(outcomes):
    """The reference run first and last in each spawn, with every other run in between: the same bits."""
    for world, runs in planned_runs().items():
        first, again = [k for k in runs if k.endswith("-again") or k + "-again" in runs]
        assert outcomes[first]["losses"] == outcomes[again]["losses"], (world, outcomes[first], outcomes[again])


@pytest.fixture(scope="module")
def field_table(outcomes):
    """The table of what each case showed, printed at the end of the module (``-s`` shows it)."""
    table: dict = {}
    yield table
    lines = [f"{'case':58} {'expect':8} {'vs ref':>9}  layouts"]
    for case in CASES:
        row = table.get(case.name, {})
        diff = f"{row['diff']:.1e}" if "diff" in row else "-"
        lay = ", ".join(f"{k} {v:.0e}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.get("layouts", {}).items())
        lines.append(f"{case.name[:58]:58} {case.expect:8} {diff:>9}  {lay or case.one_layout[:40] or '-'}")
    print("\n" + "\n".join(lines))
