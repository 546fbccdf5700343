"""Upcycling (``moe_plugin/checkpoint/upcycle.py``, ``moe-plugin upcycle``): the MoE model made from a
dense checkpoint computes the dense model's function at step 0, under any layout, and trains on.

A tiny Megatron-Core GPT without linear biases (2 layers; layer 0 becomes MoE, layer 1 stays dense)
is trained 2 steps by the engine and saved; it is upcycled into 4 experts top-2 with normalised
gates and no capacity (``drop_tokens`` false): 4 copies (granularity 1), and 2 copies cut into 2
pieces each (granularity 2, ``gate_scale`` 2, virtual router groups). Each MoE checkpoint is loaded
by ``load_checkpoint`` with its default arguments (the usual resume path: the optimizer starts
fresh because the metadata says so), and the per-token losses of a fixed batch equal the dense
model's to fp32 rounding (the experts' GEMMs sum in another order than Megatron's linears, and
normalised gates sum to 1 within an ulp): on 1 rank, and in a 4-rank spawn under ep 2 (dp 4),
tp 2 x ep 2 and pp 2 x ep 2 (the PipelineEngine), from a dense checkpoint saved at tp 2. Then one training step runs, continuing the
dense run's step counter (or from 0 with ``keep_iteration=False``). In the parent: bad target
configs fail naming the key and leave nothing behind, MLP biases are refused unless dropped, and
the command runs in-process.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from gpt_tiny import eval_losses, shifted_batch
import ds_json

VOCAB, SEQ, BATCH, HIDDEN, FFN = 32, 8, 4, 16, 32
DENSE_STEPS = 2
BASE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "layer_interval": 2}
TARGETS = {1: BASE, 2: {**BASE, "ffn_hidden_size": FFN // 2, "gate_scale": 2.0}}   # granularity -> "moe" block
UNNORMALISED = {**BASE, "normalize_gates": False}   # allowed with allow_inexact: gates sum below 1
# the pipeline case: MoE layers on both stages (DeepSpeed's PipelineEngine loads a stage without any
# MoE layer through another path, which fails on a plugin checkpoint)
EVERY_LAYER = {**TARGETS[2], "layer_interval": 1}
TOLERANCE = 1e-5   # seen: 2.4e-7 (one ulp of a loss near 3.5)


# -- inside the ranks ------------------------------------------------------------------------------
def _engine(moe: dict, parallel: dict, world_size: int, *, dense: bool = False, bias: bool = False):
    import moe_plugin

    def provide(moe_config, groups):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        from moe_plugin.integration.megatron import gpt_dense_spec, gpt_moe_spec

        config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                                   tensor_model_parallel_size=groups.layout.sizes.tp, use_cpu_initialization=True,
                                   add_bias_linear=bias, hidden_dropout=0.0, attention_dropout=0.0,
                                   bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                   masked_softmax_fusion=False, apply_rope_fusion=False)
        torch.manual_seed(1234)
        spec = gpt_dense_spec(config) if dense else gpt_moe_spec(moe_config, config, groups, seed=1234)
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)

    dp = world_size // parallel.get("tensor", 1)
    cfg = ds_json.ds_config(batch=BATCH, dp=dp, clip=None, zero=0, moe=moe, parallel=parallel,
                            optimizer={"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
                            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3}})
    return moe_plugin.initialize(cfg, provide)


def _batch(step: int):
    return shifted_batch(step, BATCH, VOCAB, SEQ)


def _train_step(run, step: int) -> float:
    c = run.groups.layout.coords(torch.distributed.get_rank())
    micro = BATCH // run.groups.layout.sizes.dp
    ids, pos, labels = (t[c["dp"] * micro:(c["dp"] + 1) * micro] for t in _batch(step))
    loss = run.engine(ids, pos, None, labels=labels).float().mean()
    run.engine.backward(loss)
    run.engine.step()
    return loss.item()


def _token_losses(run) -> torch.Tensor:
    """Per-token losses [B, S] of one fixed batch, every rank the whole batch, eval mode."""
    return eval_losses(run.engine.module, _batch(999))


def _save_dense(root: str, parallel: dict, world_size: int, bias: bool = False) -> torch.Tensor:
    from moe_plugin.checkpoint import save_checkpoint

    run = _engine(BASE, parallel, world_size, dense=True, bias=bias)
    try:
        for step in range(DENSE_STEPS):
            _train_step(run, step)
        save_checkpoint(run, os.path.join(root, "dense-bias" if bias else "dense"), client_state={"step": DENSE_STEPS})
        return _token_losses(run)
    finally:
        run.close()


def _upcycle_on_rank0(root: str, keep_iteration: bool = True) -> None:
    from moe_plugin.checkpoint import upcycle_checkpoint

    if torch.distributed.get_rank() == 0:
        for g, moe in TARGETS.items():
            upcycle_checkpoint(os.path.join(root, "dense"), {"moe": moe}, os.path.join(root, f"g{g}"), granularity=g,
                               progress=lambda line: None)
        upcycle_checkpoint(os.path.join(root, "dense"), {"moe": BASE}, os.path.join(root, "g1-reset"),
                           keep_iteration=False, progress=lambda line: None)
        upcycle_checkpoint(os.path.join(root, "dense"), {"moe": UNNORMALISED}, os.path.join(root, "g1-unnormalised"),
                           allow_inexact=True, progress=lambda line: None)
        upcycle_checkpoint(os.path.join(root, "dense"), {"moe": EVERY_LAYER}, os.path.join(root, "g2-every-layer"),
                           granularity=2, progress=lambda line: None)
    torch.distributed.barrier()


def _load_and_train(root: str, name: str, g: int, parallel: dict, world_size: int, moe: dict = None) -> dict:
    from moe_plugin.checkpoint import load_checkpoint

    run = _engine(moe or TARGETS[g], parallel, world_size)
    try:
        _path, client = load_checkpoint(run, os.path.join(root, name))   # the default: with optimizer states
        out = {"losses": _token_losses(run), "global_steps": run.engine.global_steps, "client": client.get("step"),
               "optimizer_state": len(run.engine.optimizer.state)}
        out["train"] = _train_step(run, DENSE_STEPS)
        out["global_steps_after"] = run.engine.global_steps
        return out
    finally:
        run.close()


def _pipe_load_and_train(root: str) -> dict:
    """``g2-every-layer`` into pp 2 x ep 2 (DeepSpeed's PipelineEngine, dp 2): the mean loss of the
    fixed batch (each replica one half, one micro-batch), then one ``train_batch``."""
    import moe_plugin
    from megatron.core.transformer import TransformerConfig

    from moe_plugin.checkpoint import load_checkpoint

    def provide(moe_config, groups):
        config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                                   pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, add_bias_linear=False,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                   masked_softmax_fusion=False, apply_rope_fusion=False)
        return moe_plugin.gpt_pipeline_module(config, moe_config, groups, vocab_size=VOCAB, max_sequence_length=SEQ,
                                              seed=1234, share_embeddings_and_output_weights=False)   # as the GPTModel

    cfg = ds_json.ds_config(batch=BATCH, dp=2, clip=None, zero=0, moe=EVERY_LAYER, parallel={"pipeline": 2, "expert": 2},
                            optimizer={"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}})
    run = moe_plugin.initialize(cfg, provide)
    try:
        load_checkpoint(run, os.path.join(root, "g2-every-layer"))
        rows = slice(run.groups.rank_in("dp") * BATCH // 2, (run.groups.rank_in("dp") + 1) * BATCH // 2)
        ids, pos, labels = (t[rows].contiguous() for t in _batch(999))
        out = {"loss": run.engine.eval_batch(iter([((ids, pos), labels)])).item()}
        out["train"] = run.engine.train_batch(iter([((ids, pos), labels)])).item()
        out["global_steps_after"] = run.engine.global_steps
        return out
    finally:
        run.close()


def _child(rank: int, world_size: int, root: str) -> dict:
    from dist import attempts

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results: dict = {}
    attempt = attempts(results, rank)
    if world_size == 1:
        results["dense"] = _save_dense(root, {}, 1)
        _save_dense(root, {}, 1, bias=True)
        _upcycle_on_rank0(root)
        for g in TARGETS:
            attempt(f"g{g}", _load_and_train, root, f"g{g}", g, {}, 1)
        attempt("g1-reset", _load_and_train, root, "g1-reset", 1, {}, 1)
        attempt("g1-unnormalised", _load_and_train, root, "g1-unnormalised", 1, {}, 1, UNNORMALISED)
        return results
    results["dense"] = _save_dense(root, {"tensor": 2}, world_size)   # a dense checkpoint of TP 2
    _upcycle_on_rank0(root)
    for layout, parallel in (("ep2", {"expert": 2}), ("tp2-ep2", {"tensor": 2, "expert": 2})):
        for g in TARGETS:
            attempt(f"{layout}-g{g}", _load_and_train, root, f"g{g}", g, parallel, world_size)
    attempt("pp2-ep2-g2", _pipe_load_and_train, root)
    return results


# -- the checks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("upcycle1")
    return str(root), run_distributed(_child, 1, root, str(root), timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("upcycle4")
    return str(root), run_distributed(_child, 4, root, str(root), timeout=300)


def _check_case(results: list, name: str) -> None:
    from dist import case_results

    for rank, (dense, case) in enumerate(zip([r["dense"] for r in results], case_results(results, name))):
        difference = (case["losses"] - dense).abs().max().item()
        assert difference < TOLERANCE, f"{name}, rank {rank}: per-token losses differ by {difference:.3g}"
        assert case["global_steps"] == DENSE_STEPS and case["client"] == DENSE_STEPS, name   # the dense step goes on
        assert case["optimizer_state"] == 0, f"{name}: the optimizer did not start fresh"
        assert math.isfinite(case["train"]) and case["global_steps_after"] == DENSE_STEPS + 1, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["g1", "g2"])
def test_one_rank_upcycled_model_computes_the_dense_function(one_rank, name):
    _check_case(one_rank[1], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2-g1", "ep2-g2", "tp2-ep2-g1", "tp2-ep2-g2"])
def test_upcycled_model_computes_the_dense_function_under_a_layout(four_ranks, name):
    _check_case(four_ranks[1], name)


@pytest.mark.slow
def test_upcycled_model_computes_the_dense_function_in_a_pipeline(four_ranks):
    """pp 2 x ep 2: the 1-rank GPTModel checkpoint read in the pipeline's names (``checkpoint/keys.py``)."""
    from dist import case_results

    for rank, (result, case) in enumerate(zip(four_ranks[1], case_results(four_ranks[1], "pp2-ep2-g2"))):
        expected = result["dense"].mean().item()   # eval_batch averages over the data-parallel replicas
        assert abs(case["loss"] - expected) < TOLERANCE, f"rank {rank}: {case['loss']} vs the dense {expected}"
        assert math.isfinite(case["train"]) and case["global_steps_after"] == DENSE_STEPS + 1


@pytest.mark.slow
def test_upcycled_experts_are_copies_and_the_function_is_not_trivially_kept(one_rank):
    """The experts hold the dense MLP (pieces of it at g 2), the router rows come in virtual groups,
    and a changed expert changes the losses (the comparison above can fail)."""
    from moe_plugin.checkpoint.export import read_full_state

    root = one_rank[0]
    dense, _, _, _ = read_full_state(os.path.join(root, "dense"), progress=lambda line: None)
    for g in TARGETS:
        moe, _, meta, _ = read_full_state(os.path.join(root, f"g{g}"), progress=lambda line: None)
        w1_EHF, router_EH = moe["decoder.layers.0.mlp.experts.weight1"], moe["decoder.layers.0.mlp.router.weight"]
        fc1_HF = dense["decoder.layers.0.mlp.linear_fc1.weight"].t()
        for e in range(4):
            piece = e % g
            assert torch.equal(w1_EHF[e], fc1_HF[:, piece * FFN // g:(piece + 1) * FFN // g])
            assert torch.equal(router_EH[e], router_EH[e - piece])
        assert len({tuple(r.tolist()) for r in router_EH}) == 4 // g
        assert torch.equal(moe["decoder.layers.1.mlp.linear_fc1.weight"], dense["decoder.layers.1.mlp.linear_fc1.weight"])
        assert meta["upcycled_from"]["granularity"] == g and meta["upcycled_from"]["global_steps"] == DENSE_STEPS
        assert meta["fresh_states"] == ["optimizer"]
    reset = one_rank[1][0]["g1-reset"]
    assert not isinstance(reset, str), reset
    assert reset["global_steps"] == 0 and reset["client"] is None and reset["global_steps_after"] == 1
    assert (reset["losses"] - one_rank[1][0]["dense"]).abs().max() < TOLERANCE
    inexact = one_rank[1][0]["g1-unnormalised"]   # the comparison can fail: unnormalised gates change the function
    assert not isinstance(inexact, str), inexact
    assert (inexact["losses"] - one_rank[1][0]["dense"]).abs().max() > 1e-3


BAD = {  # name -> (granularity, "moe" block, the start of the message)
    "experts": (2, {**TARGETS[2], "num_experts": 6, "top_k": 2}, "moe.ffn_hidden_size"),
    "odd-experts": (2, {**TARGETS[2], "num_experts": 3}, "moe.num_experts: got 3; must be a multiple of the granularity 2"),
    "ffn": (2, {**TARGETS[2], "ffn_hidden_size": FFN}, "moe.ffn_hidden_size: got 32; must be the dense FFN size / granularity = 32 / 2 = 16"),
    "gate-scale": (2, {**TARGETS[2], "gate_scale": 1.0}, "moe.gate_scale: got 1.0; must be the granularity 2"),
    "switch": (1, {**BASE, "router": "switch", "top_k": 1}, "moe.router: got 'switch'; the gates must be normalised"),
    "unnormalised": (1, {**BASE, "normalize_gates": False}, "moe.normalize_gates: got False"),
    "top-k": (2, {**TARGETS[2], "top_k": 3}, "moe.top_k: got 3; must be a multiple of the granularity 2"),
    "random-routing": (1, {**BASE, "router": "gshard"}, "moe.second_expert_policy: got 'random'"),
    "layers": (1, {**{k: v for k, v in BASE.items() if k != "layer_interval"}, "layers": [0, 2]}, "moe.layers: got [0, 2]"),
    "activation": (1, {**BASE, "activation": "swiglu"}, "moe.activation: got 'swiglu'; must be the dense MLP's activation (gelu)"),
    "shared": (1, {**BASE, "shared_expert_ffn_hidden_size": 8}, "moe.shared_expert_ffn_hidden_size: got 8"),
    "granularity": (0, BASE, "granularity: got 0; expected an integer >= 1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_bad_target_fails_naming_the_key_before_writing(one_rank, tmp_path, name):
    from moe_plugin.checkpoint import upcycle_checkpoint
    from moe_plugin.configs import ConfigError

    g, moe, message = BAD[name]
    if name == "experts":   # 6 experts of 16 at g 2 fit; ffn 8 does not
        moe = {**moe, "ffn_hidden_size": 8}
    with pytest.raises(ConfigError) as failure:
        upcycle_checkpoint(os.path.join(one_rank[0], "dense"), {"moe": moe}, tmp_path / "out", granularity=g,
                           progress=lambda line: None)
    assert str(failure.value).startswith(message), str(failure.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_mlp_biases_are_refused_unless_dropped(one_rank, tmp_path):
    from moe_plugin.checkpoint import CheckpointError, upcycle_checkpoint

    dense = os.path.join(one_rank[0], "dense-bias")
    with pytest.raises(CheckpointError, match=r"dense MLPs have biases \(decoder\.layers\.0\.mlp\.linear_fc1\.bias"):
        upcycle_checkpoint(dense, {"moe": BASE}, tmp_path / "out", progress=lambda line: None)
    assert not (tmp_path / "out").exists()
    done = upcycle_checkpoint(dense, {"moe": BASE}, tmp_path / "out", drop_mlp_bias=True, progress=lambda line: None)
    assert done.dropped_biases == ("decoder.layers.0.mlp.linear_fc1.bias", "decoder.layers.0.mlp.linear_fc2.bias")
    with pytest.raises(CheckpointError, match="exists; upcycle into another --out directory"):
        upcycle_checkpoint(dense, {"moe": BASE}, tmp_path / "out", drop_mlp_bias=True, progress=lambda line: None)


@pytest.mark.slow
def test_command_upcycles_and_reports(one_rank, tmp_path, capsys):
    from moe_plugin.compat.deepspeed_checkpoint import ENGINE_KEYS
    from moe_plugin_tools.cli import main

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": BATCH, "moe": TARGETS[2]}))
    dense = os.path.join(one_rank[0], "dense")
    assert main(["upcycle", dense, "--config", str(config), "--out", str(tmp_path / "moe"), "--granularity", "2"]) == 0
    out = capsys.readouterr().out
    assert f"-> {tmp_path / 'moe' / 'global_step2'}" in out and "4 experts each = 2 copies of the dense MLP x 2 pieces" in out
    assert "resumes at step 2; optimizer state fresh" in out
    assert (tmp_path / "moe" / "latest").read_text() == "global_step2"
    with pytest.raises(SystemExit) as failure:
        main(["upcycle", dense, "--config", str(config), "--out", str(tmp_path / "moe2")])   # granularity 1
    assert failure.value.code == 2 and "moe.ffn_hidden_size: got 16" in capsys.readouterr().err
    # version guard: every entry DeepSpeed wrote in the dense module file is one it owns, or the client state
    saved = torch.load(os.path.join(dense, "global_step2", "mp_rank_00_model_states.pt"), weights_only=False)
    assert set(saved) - ENGINE_KEYS == {"step"}, sorted(set(saved) - ENGINE_KEYS)
