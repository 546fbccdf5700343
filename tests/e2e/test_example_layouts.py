"""The example trains one model under every layout: pipeline and sequence-parallel runs give the 1-rank losses.

``examples/gpt_moe/pretrain_gpt_moe.py`` (its ``main``, on gloo ranks as the launcher would start it)
trains 8 steps of the same global batches, seed 7, with dropless GShard routing whose second expert
is deterministic (``second_expert_policy: "all"``) and the example's optimizer (AdamW warmed up over
20 steps), on 1 rank and under pp2 x ep2 (ZeRO-0), tp2 x pp2
x ep2 and pp2 x dp2 x ep2 (ZeRO-1, the second with 2 micro-batches per replica), and tp2 x ep2
with sequence parallelism (ZeRO-1: Megatron's RNG tracker and sequence-parallel buffers on the CPU
are what ``moe_plugin.initialize`` sets up, ``compat/megatron_cpu.py``). The per-step
training losses must equal the one-rank run's to 1e-4 relative: the pipeline stages hold the
one-rank ``GPTModel``'s weights, the word embedding and output layer tied across the first and last
stage as the one-rank model ties them (the example's default, Megatron-LM's), and the same with
``--untie-embeddings-and-output-weights``. A pp2 x ep2 checkpoint loads into the one-rank
``GPTModel`` and a checkpoint of that loads back into pp2 x ep2, with the one-rank run's losses.

The Llama-style model (``LLAMA``: every architecture flag at once, swiglu experts) gives the one-rank
losses to 1e-5 under tp2 x ep2, pp2 x ep2, ep4 and tp2 x pp2 x ep2 (one 4-rank spawn runs them); its
tp2 x ep2 checkpoint exports to the one-rank run's weights and loads into the one-rank model, and its
dense model (``--dense``) upcycled computes the dense model's next loss.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from example_runs import MODEL_FLAGS, run_main
from ds_json import write_ds_config

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

STEPS = 8
MOE = {"num_experts": 4, "router": "gshard", "second_expert_policy": "all", "drop_tokens": False,
       "aux_loss_coeff": 0.01, "layer_interval": 1}
# name -> world size, moe.parallel, ZeRO stage
LAYOUTS = {
    "pp2-ep2": (4, {"pipeline": 2, "expert": 2}, 0),
    "tp2-pp2-ep2": (4, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 1),
    "pp2-dp2-ep2": (4, {"pipeline": 2, "expert": 2}, 1),
    "tp2sp-ep2": (4, {"tensor": 2, "expert": 2, "sequence_parallel": True}, 1),
}
# the Llama-style model: every architecture flag at once (4 heads: 2 query groups of 2 heads)
LLAMA = ("--num-attention-heads", "4", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--position-embedding-type", "rope", "--rotary-base", "5000", "--swiglu", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--qk-layernorm", "--untie-embeddings-and-output-weights",
         "--no-plot")
LLAMA_MOE = {**MOE, "activation": "swiglu"}
LLAMA_LAYOUTS = {   # 4 ranks each: moe.parallel, ZeRO stage
    "tp2-ep2": ({"tensor": 2, "expert": 2}, 1),
    "pp2-ep2": ({"pipeline": 2, "expert": 2}, 0),
    "ep4": ({"expert": 4}, 1),
    "tp2-pp2-ep2": ({"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 1),   # RoPE, QK-norm per stage
}
BATCH, MICRO = 8, 2
# the example's JSON (configs/tiny_cpu_4rank.json): AdamW warmed up over 20 steps
OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-08,
                                                       "weight_decay": 0.1, "torch_adam": True}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002,
                                                          "warmup_num_steps": 20}}}


def _ds_config(path: Path, dp: int, parallel: dict, stage: int, moe: dict = MOE) -> Path:
    write_ds_config(path, batch=BATCH, micro=MICRO, dp=dp, zero=stage, moe=moe, parallel=parallel, **OPTIMIZER)
    return path


def _losses(tmp_path: Path, name: str, world_size: int, parallel: dict, stage: int, *extra: str,
            first_step: int = 1, moe: dict = MOE) -> list[float]:
    return _runs(tmp_path, world_size, [(name, parallel, stage, extra, first_step, moe)])[name]


def _runs(tmp_path: Path, world_size: int, runs: list[tuple]) -> dict[str, list[float]]:
    """The example run after run in one spawn of ``world_size`` ranks (each run: name, moe.parallel, ZeRO
    stage, extra flags, first step, "moe" block); the training losses of each, by name."""
    argvs, expected = [], {}
    for name, parallel, stage, extra, first_step, moe in runs:
        tp, pp = parallel.get("tensor", 1), parallel.get("pipeline", 1)
        flags = [f for f in MODEL_FLAGS]
        flags[flags.index("--train-iters") + 1] = str(STEPS)   # a later --train-iters in extra wins
        flags[flags.index("--eval-interval") + 1] = "0"
        ds = _ds_config(tmp_path / f"{name}.json", world_size // (tp * pp), parallel, stage, moe)
        argvs.append([*flags, "--micro-batch-size", str(MICRO), "--deepspeed_config", str(ds),
                      "--run-dir", str(tmp_path / "runs" / name), "--data-cache", str(tmp_path / "data"), *extra])
        last = int(extra[extra.index("--train-iters") + 1]) if "--train-iters" in extra else STEPS
        expected[name] = list(range(first_step, last + 1))
    results = run_distributed(_run_mains, world_size, tmp_path, argvs, timeout=400 * len(argvs))
    assert [r["status"] for r in results] == [[0] * len(argvs)] * world_size
    out = {}
    for name, steps in expected.items():
        records = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["split"] == "train"]
        assert [r["step"] for r in train] == steps, name
        out[name] = [r["loss"] for r in train]
    return out


def _run_mains(rank: int, world_size: int, argvs: list) -> dict:
    """The example's ``main`` once per argv, one after the other (each builds and closes its engine)."""
    return {"status": [run_main(rank, world_size, argv)["status"] for argv in argvs]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def one_rank(data_dir) -> list[float]:
    """The one-rank run (tied embeddings): the reference of the tied layouts and of the checkpoint's
    uninterrupted run."""
    return _losses(data_dir, "one-tied", 1, {}, 1)


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_pipeline_layouts_give_the_one_rank_losses(data_dir, one_rank, tie):
    extra = ("--untie-embeddings-and-output-weights",) if tie == "untied" else ()
    one = one_rank if tie == "tied" else _losses(data_dir, f"one-{tie}", 1, {}, 1, *extra)
    names = list(LAYOUTS) if tie == "tied" else ["pp2-dp2-ep2"]
    for name in names:
        world, parallel, stage = LAYOUTS[name]
        got = _losses(data_dir, f"{name}-{tie}", world, parallel, stage, *extra)
        assert got == pytest.approx(one, rel=1e-4), (name, got, one)


def test_pipeline_checkpoint_loads_into_the_one_rank_gpt_model_and_back(data_dir, one_rank):
    """pp2 x ep2 saves after 4 steps; the one-rank ``GPTModel`` loads it (weights only: another
    model kind) and its step 5 is the uninterrupted one-rank run's; it saves after step 6, and pp2 x
    ep2 and the one-rank model both load that and compute the same step-7 loss."""
    world, parallel, stage = LAYOUTS["pp2-ep2"]
    uninterrupted = one_rank
    first, second = str(data_dir / "ckpt-pp2"), str(data_dir / "ckpt-one")
    _losses(data_dir, "ckpt-pp2-a", world, parallel, stage, "--train-iters", "4", "--save", first)
    resumed = _losses(data_dir, "ckpt-one-b", 1, {}, 1, "--train-iters", "6", "--load", first, "--no-load-optim",
                      "--save", second, first_step=5)
    assert resumed[0] == pytest.approx(uninterrupted[4], rel=1e-4), (resumed, uninterrupted)
    pipe = _losses(data_dir, "ckpt-pp2-c", world, parallel, stage, "--train-iters", "7", "--load", second,
                   "--no-load-optim", first_step=7)
    one = _losses(data_dir, "ckpt-one-c", 1, {}, 1, "--train-iters", "7", "--load", second, "--no-load-optim",
                  first_step=7)
    assert pipe == pytest.approx(one, rel=1e-5), (pipe, one)


@pytest.mark.slow
def test_llama_style_model_under_every_layout(data_dir):
    """RMSNorm, RoPE, swiglu dense MLPs and experts, no biases, grouped-query attention (2 key/value
    heads for 4 query heads), QK-norm and an untied output layer: tp2 x ep2, pp2 x ep2, ep4 and
    tp2 x pp2 x ep2 give the one-rank run's losses; the tp2 x ep2 checkpoint exports to the one-rank run's weights
    (QKV of fewer key/value heads, the swiglu ``linear_fc1`` and the QK-norms joined) and loads into
    the one-rank model (weights only), whose next step computes the uninterrupted run's loss. The
    dense model (``--dense``) trained at tp2 and upcycled (``moe-plugin upcycle``) computes the dense
    model's next loss on one rank."""
    from moe_plugin.checkpoint import upcycle_checkpoint
    from moe_plugin.checkpoint.export import export_checkpoint, load_export

    saved, dense, upcycled = data_dir / "llama-tp2-ckpt", data_dir / "llama-dense-ckpt", data_dir / "llama-upcycled"
    layouts = _runs(data_dir, 4, [   # one spawn, the layouts one after the other; tp2 x ep2 saves after STEPS
        (f"llama-{name}", parallel, stage, LLAMA + (("--save", str(saved)) if name == "tp2-ep2" else ()), 1, LLAMA_MOE)
        for name, (parallel, stage) in LLAMA_LAYOUTS.items()] + [   # and the dense model at tp2, saved after STEPS
        ("llama-dense", LLAMA_LAYOUTS["tp2-ep2"][0], 1, LLAMA + ("--dense", "--train-iters", str(STEPS + 1),
                                                                  "--save", str(dense), "--save-interval", str(STEPS)),
         1, LLAMA_MOE)])
    dense_next = layouts.pop("llama-dense")[STEPS:]
    upcycle_checkpoint(dense, {"moe": LLAMA_MOE}, upcycled, tag=f"step{STEPS}", progress=lambda line: None)
    ones = _runs(data_dir, 1, [   # uninterrupted (saved after STEPS), then resumed from the tp2 checkpoint
        ("llama-one", {}, 1, LLAMA + ("--train-iters", str(STEPS + 1), "--save-interval", str(STEPS), "--save",
                                      str(data_dir / "llama-one-ckpt")), 1, LLAMA_MOE),
        ("llama-one-resumed", {}, 1, LLAMA + ("--train-iters", str(STEPS + 1), "--load", str(saved),
                                              "--no-load-optim"), STEPS + 1, LLAMA_MOE),
        ("llama-upcycled", {}, 1, LLAMA + ("--train-iters", str(STEPS + 1), "--load", str(upcycled)), STEPS + 1,
         LLAMA_MOE)])
    one = ones["llama-one"]
    for name, got in layouts.items():
        assert got == pytest.approx(one[:STEPS], rel=1e-5), (name, got, one)
    assert ones["llama-one-resumed"] == pytest.approx(one[STEPS:], rel=1e-5), (ones, one)
    # upcycled from the dense model's step STEPS: the MoE model computes the dense function at first
    assert ones["llama-upcycled"] == pytest.approx(dense_next, rel=1e-5), (ones["llama-upcycled"], dense_next)
    exports = {}
    for run, path in (("one", data_dir / "llama-one-ckpt"), ("tp2", saved)):
        export_checkpoint(path, data_dir / f"llama-{run}-export", tag=f"step{STEPS}", progress=lambda line: None)
        exports[run] = load_export(data_dir / f"llama-{run}-export")
    (mine, config), (theirs, _) = exports["tp2"], exports["one"]
    assert (config["position_embedding_type"], config["rotary_base"]) == ("rope", 5000.0), config
    assert {k: config["transformer_config"][k] for k in ("normalization", "num_query_groups", "qk_layernorm")} == \
        {"normalization": "RMSNorm", "num_query_groups": 2, "qk_layernorm": True}
    assert sorted(mine) == sorted(theirs) and "decoder.layers.0.self_attention.q_layernorm.weight" in mine
    for key, value in theirs.items():   # 8 Adam steps of lr <= 8e-4: layouts round differently, in lr units
        torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_projection_qk_norm_trains_alike_under_tensor_parallelism(data_dir):
    """OLMoE's QK-norm (``--qk-layernorm-scope projection``: one RMSNorm over all heads of the query and
    of the key projection, its mean square summed over TP, its weight split by head) on the Llama-style
    model: tp2 x ep2, tp2 x ep2 with sequence parallelism and tp2 x pp2 x ep2 give the one-rank run's
    losses (the gradients flow through the TP all-reduce of the statistic); the tp2 checkpoint exports
    to the one-rank run's weights, the norm's full [heads x head size] weight joined from both ranks."""
    olmoe = LLAMA + ("--qk-layernorm-scope", "projection")
    saved = data_dir / "olmoe-tp2-ckpt"
    layouts = _runs(data_dir, 4, [
        ("olmoe-tp2-ep2", {"tensor": 2, "expert": 2}, 1, olmoe + ("--save", str(saved)), 1, LLAMA_MOE),
        ("olmoe-tp2sp-ep2", {"tensor": 2, "expert": 2, "sequence_parallel": True}, 1, olmoe, 1, LLAMA_MOE),
        ("olmoe-tp2-pp2-ep2", LLAMA_LAYOUTS["tp2-pp2-ep2"][0], 1, olmoe, 1, LLAMA_MOE)])
    one = _runs(data_dir, 1, [("olmoe-one", {}, 1, olmoe + ("--save", str(data_dir / "olmoe-one-ckpt")), 1,
                               LLAMA_MOE)])["olmoe-one"]
    head = _runs(data_dir, 1, [("olmoe-head", {}, 1, LLAMA, 1, LLAMA_MOE)])["olmoe-head"]
    assert head != pytest.approx(one, rel=1e-4)   # the scope changes the model
    for name, got in layouts.items():
        assert got == pytest.approx(one, rel=1e-5), (name, got, one)
    mine, theirs = _exported(data_dir, "olmoe", saved)
    assert mine["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (32,)   # 4 heads of 8
    assert mine["decoder.layers.0.self_attention.k_layernorm.weight"].shape == (16,)   # 2 groups of 8
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _exported(data_dir: Path, prefix: str, saved: Path) -> tuple[dict, dict]:
    """The weights of ``saved`` (a tp2 run's checkpoint) and of ``{prefix}-one-ckpt``, each exported as
    the one-rank model."""
    from moe_plugin.checkpoint.export import export_checkpoint, load_export

    out = []
    for run, path in (("tp2", saved), ("one", data_dir / f"{prefix}-one-ckpt")):
        export_checkpoint(path, data_dir / f"{prefix}-{run}-export", progress=lambda line: None)
        out.append(load_export(data_dir / f"{prefix}-{run}-export")[0])
    return out[0], out[1]


# GLM-4.5's shape on the Llama-style model: half of each head rotated, QKV biases, a dense first layer,
# sigmoid scores with DeepSeek's group-limited choice (2 of 4 groups), scaled gates, an ungated shared expert
GLM = LLAMA + ("--rotary-percent", "0.5", "--add-qkv-bias")
GLM_MOE = {"num_experts": 8, "router": "topk", "top_k": 2, "score_function": "sigmoid", "router_groups": 4,
           "group_topk": 2, "gate_scale": 2.5, "shared_expert_ffn_hidden_size": 32, "drop_tokens": False,
           "activation": "swiglu", "layers": [1], "bias_update_rate": 0.01}


def test_glm_style_model_trains_alike_under_every_layout(data_dir):
    """The GLM-4.5-shaped model gives the one-rank losses under tp2 x ep2 (ZeRO-1) and pp2 x ep2
    (ZeRO-0: the first stage holds the dense layer only, and takes DeepSpeed's MoE code paths like the
    other: ``expert_params.mark_every_stage``), the aux-loss-free bias moving every step."""
    layouts = _runs(data_dir, 4, [
        ("glm-tp2-ep2", {"tensor": 2, "expert": 2}, 1, GLM, 1, GLM_MOE),
        ("glm-pp2-ep2", {"pipeline": 2, "expert": 2}, 0, GLM, 1, GLM_MOE)])
    one = _runs(data_dir, 1, [("glm-one", {}, 1, GLM, 1, GLM_MOE)])["glm-one"]
    full = _runs(data_dir, 1, [("glm-full-rotary", {}, 1, LLAMA + ("--add-qkv-bias",), 1, GLM_MOE)])["glm-full-rotary"]
    assert full != pytest.approx(one, rel=1e-4)   # --rotary-percent changes the model
    for name, got in layouts.items():
        assert got == pytest.approx(one, rel=1e-5), (name, got, one)


# DeepSeek-V3's shape on the tiny model: multi-latent attention (a low-rank query with its norm, a compressed
# key/value with its norm, a rotary key shared by the heads, keys wider than values) with YaRN past its
# original context of 8, and GLM_MOE's DeepSeek routing (a dense first layer, 2 of 4 groups, a shared expert);
# weights of std 0.2, so that attention is far from uniform (YaRN's scales show in the losses)
DEEPSEEK = ("--num-attention-heads", "4", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
            "--position-embedding-type", "rope", "--rotary-base", "5000", "--swiglu", "--disable-bias-linear",
            "--qk-layernorm", "--untie-embeddings-and-output-weights", "--no-plot", "--multi-latent-attention",
            "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
            "--v-head-dim", "6", "--init-method-std", "0.2", "--rope-scaling",
            json.dumps({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "mscale": 1.0,
                        "mscale_all_dim": 0.8}))


def test_multi_latent_attention_trains_alike_under_every_layout(data_dir):
    """The DeepSeek-shaped model (Megatron's ``MLASelfAttention`` through ``compat/megatron_mla``) gives the
    one-rank losses under tp2 x ep2 (ZeRO-1: the down projections split over TP, the latent norms
    replicated), tp2 x ep2 with sequence parallelism (the latent norms' gradients summed over TP), pp2 x ep2
    and tp2 x pp2 x ep2 (ZeRO-0: the first stage holds the dense layer only; MLA rotates inside each stage's
    layers); the tp2 checkpoint exports to the
    one-rank run's weights. Without YaRN the losses differ (the scaling is applied)."""
    mine = _alike_under_every_layout(data_dir, "mla", DEEPSEEK, GLM_MOE, 0, DEEPSEEK[:DEEPSEEK.index("--rope-scaling")])
    assert mine["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape == (20, 32)   # 12 + 8 rows


def _alike_under_every_layout(data_dir: Path, prefix: str, flags: tuple, moe: dict, pp_stage: int,
                              without: tuple) -> dict:
    """The model of ``flags`` trained under tp2 x ep2 (ZeRO-1, saved), tp2 x ep2 with SP, pp2 x ep2 and
    tp2 x pp2 x ep2 (ZeRO ``pp_stage``) gives the one-rank losses (rel 1e-5), the model of ``without`` other
    losses; the tp2 checkpoint exports to the one-rank run's weights, which are returned."""
    saved = data_dir / f"{prefix}-tp2-ckpt"
    layouts = _runs(data_dir, 4, [
        (f"{prefix}-tp2-ep2", {"tensor": 2, "expert": 2}, 1, flags + ("--save", str(saved)), 1, moe),
        (f"{prefix}-tp2sp-ep2", {"tensor": 2, "expert": 2, "sequence_parallel": True}, 1, flags, 1, moe),
        (f"{prefix}-pp2-ep2", {"pipeline": 2, "expert": 2}, pp_stage, flags, 1, moe),
        (f"{prefix}-tp2-pp2-ep2", LLAMA_LAYOUTS["tp2-pp2-ep2"][0], pp_stage, flags, 1, moe)])
    ones = _runs(data_dir, 1, [(f"{prefix}-one", {}, 1, flags + ("--save", str(data_dir / f"{prefix}-one-ckpt")), 1,
                                moe), (f"{prefix}-without", {}, 1, without, 1, moe)])
    one = ones[f"{prefix}-one"]
    assert ones[f"{prefix}-without"] != pytest.approx(one, rel=1e-4)
    for name, got in layouts.items():
        assert got == pytest.approx(one, rel=1e-5), (name, got, one)
    mine, theirs = _exported(data_dir, prefix, saved)
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    return mine


# GPT-OSS's shape on the tiny model: attention sinks, biases on q/k/v and the output projection, heads of 12
# over a hidden size of 32, a window of 4 on every other layer, YaRN (truncate false); every layer MoE with
# the router's logit bias, the clamped SwiGLU (a limit that cuts at init std 0.2) and expert biases
GPT_OSS = ("--num-attention-heads", "4", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
           "--rotary-base", "5000", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
           "--kv-channels", "12", "--add-qkv-bias", "--softmax-type", "learnable", "--window-size", "3,0",
           "--window-attn-skip-freq", "2", "--untie-embeddings-and-output-weights", "--no-plot",
           "--init-method-std", "0.2", "--rope-scaling",
           json.dumps({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "truncate": False}))
GPT_OSS_MOE = {"num_experts": 8, "router": "topk", "top_k": 2, "drop_tokens": False, "activation": "clamped_swiglu",
               "swiglu_limit": 1.0, "expert_linear_bias": True, "router_logit_bias": True}


def test_gpt_oss_style_model_trains_alike_under_every_layout(data_dir):
    """The GPT-OSS-shaped model gives the one-rank losses under tp2 x ep2 (ZeRO-1; the sinks split over TP by
    head, the experts over ETP 2 with the output bias added on ETP rank 0), tp2 x ep2 with sequence
    parallelism, pp2 x ep2 and tp2 x pp2 x ep2; the tp2 checkpoint exports to the one-rank run's weights.
    Without the sinks the losses differ (they are applied)."""
    vanilla = tuple("vanilla" if f == "learnable" else f for f in GPT_OSS)   # no sinks
    mine = _alike_under_every_layout(data_dir, "oss", GPT_OSS, GPT_OSS_MOE, 1, vanilla)
    assert mine["decoder.layers.0.self_attention.core_attention.softmax_offset"].shape == (4,)
    assert mine["decoder.layers.0.mlp.experts.bias2"].shape == (8, 32)
