"""Pipeline parallelism: a Megatron-Core GPT-MoE on DeepSpeed's PipelineEngine, against one process.

The model: 4 layers, hidden 16, 4 experts on layers 0 and 2 (one MoE layer per stage with two
stages), vocabulary 64, sequences of 8, global batch 4, 2 micro-batches per step. Routing is dropless
top-2 without noise and the only aux loss is the z-loss (a mean over tokens): the GShard balance loss
is per micro-batch by design, so it would differ from one process. Each case trains ``STEPS`` SGD
steps with gradient clipping (active: ``CLIP`` is below every step's norm) through
``moe_plugin.initialize`` -> ``PipelineEngine.train_batch``, from the weights of
``gpt_pipeline_module`` (layout independent by construction). The oracle runs on one process: a
plain Megatron ``GPTModel`` loaded with the pp = 1 pipeline's weights (first checked to give the
pipeline's logits), the whole batch at once, ``clip_grad_norm_`` and ``torch.optim.SGD``. Compared,
fp32, rtol 1e-5: the engine's loss every step (the mean over micro-batches and data-parallel
replicas), ``engine.get_global_grad_norm()``, and every parameter shard after the last step. The z-loss
gradient must reach the router of the second stage: its weights match the oracle's and are far from
those of an oracle trained without the z-loss.

One spawn per world size serves its cases (2 ranks: pp2 with ZeRO-0 and ZeRO-1 and two error
paths; 4 ranks: pp2 x ep2 with ZeRO-0 and ZeRO-1; 8 ranks: tp2 x pp2 x ep2 ZeRO-1, EP folded over
TP, in the default order and in ``tp-ep-pp-dp``, where the stages are not the slowest dimension).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from dist import attempts, case_results, run_distributed
from gpt_tiny import (MODEL, SEQ, VOCAB, global_batch, micro_batches, one_rank_groups, pipeline_provider, torch_steps,
                      transformer_config)
import ds_json
from moe_plugin.configs import ConfigError, MoEConfig

B, GAS, SEED = 4, 2, 11
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.1, "layer_interval": 2}
STEPS, LR, CLIP = 3, 0.5, 0.3
TOL = dict(rtol=1e-5, atol=1e-6)
ROUTER_STAGE_2 = f"{1 + 2}.layer.mlp.router.weight"   # global layer 2: the first layer of stage 2

# name -> world size, moe.parallel, ZeRO stage
CASES = {
    "pp2/zero0": (2, {"pipeline": 2}, 0),
    "pp2/zero1": (2, {"pipeline": 2}, 1),
    "pp2-ep2/zero0": (4, {"pipeline": 2, "expert": 2}, 0),
    "pp2-ep2/zero1": (4, {"pipeline": 2, "expert": 2}, 1),
    "tp2-pp2-ep2/zero1": (8, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}, 1),
    # pp not the slowest dimension: stages interleave with the data-parallel replicas.
    "tp2-pp2-ep2/tp-ep-pp-dp/zero1": (8, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1,
                                          "order": "tp-ep-pp-dp"}, 1),
}


# --- shared by parent and ranks ----------------------------------------------------------------------
def _config(tp: int = 1, pp: int = 1):
    return transformer_config(MODEL, tp, pp)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens, positions, labels, each [B, SEQ]."""
    return global_batch(step, B)


def ds_config(parallel: dict, stage: int, dp: int, moe: dict = MOE) -> dict:
    return ds_json.ds_config(batch=B, dp=dp, gas=GAS, clip=CLIP, optimizer={"type": "SGD", "params": {"lr": LR}},
                             zero=stage, zero_allow_untested_optimizer=True, moe=moe, parallel=parallel)


def _provider(tp: int, pp: int):
    return pipeline_provider(MODEL, tp, pp, seed=SEED)


# --- the oracle (one rank) ----------------------------------------------------------------------------
def _oracle(rank: int, world_size: int) -> dict:
    from megatron.core.models.gpt import GPTModel

    from moe_plugin.integration.megatron import gpt_moe_spec
    from moe_plugin.integration.pipeline import gpt_pipeline_module, gpt_state_dict_key, pipeline_state_dict_key

    with one_rank_groups() as groups:
        config = _config()
        num = MODEL["num_layers"]
        pipe = gpt_pipeline_module(config, MoEConfig.from_dict(MOE), groups, vocab_size=VOCAB, max_sequence_length=SEQ,
                                   seed=SEED)
        initial = {gpt_state_dict_key(k, num): v.clone() if torch.is_tensor(v) else v
                   for k, v in pipe.state_dict().items()}
        out: dict = {}
        for name, moe in {"z": MOE, "no-z": {**MOE, "z_loss_coeff": 0.0}}.items():
            model = GPTModel(config, gpt_moe_spec(MoEConfig.from_dict(moe), config, groups), vocab_size=VOCAB,
                             max_sequence_length=SEQ)
            model.load_state_dict(initial)   # strict: the pipeline has exactly GPTModel's keys
            if name == "z":
                tokens, positions, _ = batch(0)
                with torch.no_grad():
                    out["pipe_logits"] = pipe((tokens, positions)).transpose(0, 1)
                    out["gpt_logits"] = model(tokens, positions, None)
                out["moe_layers"] = [layer.moe_layer_index for layer in model.decoder.layers]
            losses, norms = torch_steps(model, torch.optim.SGD(model.parameters(), lr=LR), map(batch, range(STEPS)),
                                        CLIP)
            final = {pipeline_state_dict_key(k, num): v.detach().clone() if torch.is_tensor(v) else v
                     for k, v in model.state_dict().items()}
            out[name] = {"losses": losses, "norms": norms, "final": final}
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return run_distributed(_oracle, 1, tmp_path_factory.mktemp("oracle"))[0]


# --- the ranks -----------------------------------------------------------------------------------------
def _train(rank: int, parallel: dict, stage: int, expected: dict) -> dict:
    import moe_plugin
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from moe_plugin.integration.pipeline import TransformerLayerPipe
    from moe_plugin.checkpoint.reshard import shard_state_dict

    moe = MoEConfig.from_dict({**MOE, "parallel": parallel})
    sizes = moe.check_world_size(int(os.environ["WORLD_SIZE"]))
    result = moe_plugin.initialize(ds_config(parallel, stage, sizes.dp), _provider(sizes.tp, sizes.pp))
    engine = result.engine
    try:
        assert isinstance(engine, PipelineEngine), type(engine)
        assert type(result.mpu).__name__ == "GroupsMPU" and result.mpu.groups is result.groups
        c = result.groups.layout.coords(rank)
        out = {"coords": c, "losses": [], "norms": [], "stage": engine.stage_id,
               "layers": [(p.layer.layer_number - 1, p.layer.moe_layer_index) for p in engine.module.forward_funcs
                          if isinstance(p, TransformerLayerPipe)]}
        for step in range(STEPS):
            loss = engine.train_batch(iter(micro_batches(step, B, c["dp"], sizes.dp, GAS)))
            out["losses"].append(loss.item())
            out["norms"].append(float(engine.get_global_grad_norm()))
        out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        for name, full in expected.items():
            shard = shard_state_dict(full, engine.module, result.groups.layout, rank)
            out[f"expected/{name}"] = {k: shard[k] for k in out["params"]}
        return out
    finally:
        result.close()


def _error_paths(rank: int) -> dict:
    """Errors raised after the groups exist (every rank raises the same, groups are released)."""
    import moe_plugin

    out = {}
    with pytest.raises(TypeError) as failure:
        moe_plugin.initialize(ds_config({"pipeline": 2}, 0, 1), lambda moe_config, groups: torch.nn.Linear(2, 2))
    out["not-a-pipe"] = str(failure.value)
    # MoE on layer 0 only: the first stage has expert param groups, the second none (ZeRO-1 refuses).
    with pytest.raises(ConfigError) as failure:
        moe_plugin.initialize(ds_config({"pipeline": 2}, 1, 1, {**MOE, "layer_interval": 8}), _provider(1, 2))
    out["one-stage-moe"] = str(failure.value)
    return out


def _ranks(rank: int, world_size: int, cases: dict, expected: dict) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))   # as the launcher
    results = {"errors": _error_paths(rank)} if world_size == 2 else {}
    attempt = attempts(results, rank)
    for name, (_, parallel, stage) in cases.items():
        attempt(name, _train, rank, parallel, stage, expected)
    return results


@pytest.fixture(scope="module")
def runs(oracle, tmp_path_factory):
    """``runs(world_size)``: every rank's results of that world size's cases (one spawn, made once)."""
    done: dict = {}
    expected = {"z": oracle["z"]["final"], "no-z": oracle["no-z"]["final"]}

    def get(world_size: int) -> list:
        if world_size not in done:
            cases = {n: c for n, c in CASES.items() if c[0] == world_size}
            done[world_size] = run_distributed(_ranks, world_size, tmp_path_factory.mktemp(f"pipe{world_size}"),
                                               cases, expected, timeout=600)
        return done[world_size]
    return get


# --- tests -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pipeline_module_is_the_gpt_model(oracle):
    torch.testing.assert_close(oracle["pipe_logits"], oracle["gpt_logits"], rtol=0, atol=0)
    assert oracle["moe_layers"] == [0, None, 2, None]
    assert all(n > CLIP for n in oracle["z"]["norms"]), "clipping should be active in every step"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_engine_matches_single_process(name, oracle, runs):
    world_size = CASES[name][0]
    per_rank = case_results(runs(world_size), name)
    ref = oracle["z"]
    for rank, result in enumerate(per_rank):
        def close(actual, expected, what):
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"rank {rank} {name} {what}: {m}")

        close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), "losses")
        close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), "global grad norms")
        assert set(result["params"]) == set(result["expected/z"])
        for pname, param in result["params"].items():
            close(param, result["expected/z"][pname], f"{pname} after {STEPS} steps")

    # Stages, global indices and MoE placement: stage s holds layers 2s, 2s+1, MoE on the even one.
    for result in per_rank:
        s = result["coords"]["pp"]
        assert result["stage"] == s
        assert result["layers"] == [(2 * s, 2 * s), (2 * s + 1, None)], result["layers"]
    # The z-loss gradient reached the second stage's router: matched above, and without it the
    # router would have ended far from there.
    second = [r for r in per_rank if r["coords"]["pp"] == 1]
    for result in second:
        with_z, without = result["expected/z"][ROUTER_STAGE_2], result["expected/no-z"][ROUTER_STAGE_2]
        assert (with_z - without).abs().max() > 1e3 * TOL["atol"], "the z-loss barely moves the router: weak check"
        torch.testing.assert_close(result["params"][ROUTER_STAGE_2], with_z, **TOL)


@pytest.mark.slow
def test_errors_after_the_groups_exist(runs):
    for result in runs(2):
        errors = result["errors"]
        assert errors["not-a-pipe"].startswith("with moe.parallel.pipeline 2 the model_provider must return a "
                                               "deepspeed.pipe.PipelineModule"), errors
        assert errors["one-stage-moe"].startswith("moe.layer_interval: got 8; leaves pipeline stage"), errors


# --- no processes ----------------------------------------------------------------------------------------
def _never(moe_config, groups):
    raise AssertionError("the model provider must not run")


@pytest.mark.parametrize("parallel, zero, world_size, extra, match", [
    ({"pipeline": 2}, 2, 2, {}, r"^zero_optimization\.stage: got 2; with moe\.parallel\.pipeline 2 the model runs on "
                                r"DeepSpeed's PipelineEngine, which supports ZeRO stages 0 and 1 only"),
    # EP 2 on stages of 4 ranks: with pp before dp the expert stages would not be the attention stages.
    ({"pipeline": 2, "expert": 2, "order": "tp-cp-ep-pp-dp"}, 1, 8, {},
     r"^moe\.parallel\.order: got 'tp-cp-ep-pp-dp'; with pipeline > 1 the order must end in 'pp'"),
    ({"pipeline": 2, "tensor": 2, "sequence_parallel": True}, 1, 4, {},
     r"^pipeline\.pipe_partitioned: got True; must be false with moe\.parallel\.sequence_parallel"),
    ({"pipeline": 2, "tensor": 2, "sequence_parallel": True}, 1, 4, {"pipeline": {"pipe_partitioned": False}},
     r"^pipeline\.grad_partitioned: got True; must be false"),
])
def test_pipeline_config_errors_come_first(parallel, zero, world_size, extra, match):
    import moe_plugin
    import torch.distributed as dist

    cfg = {**ds_config(parallel, zero, 1), **extra}
    with pytest.raises(ConfigError, match=match):
        moe_plugin.initialize(cfg, _never, world_size=world_size)
    assert not dist.is_initialized()


def test_topology_reproduces_the_layout_for_every_order():
    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.integration.pipe_topology import pipeline_topology

    checked = 0
    for tp, pp, ep, etp in itertools.product((1, 2), (1, 2, 4), (1, 2), (1, 2)):
        for tokens in itertools.permutations(["tp", "ep", "dp", "pp"]):
            try:
                layout = RankLayout.build(16, tp=tp, pp=pp, ep=ep, etp=etp, order="-".join(tokens))
            except ConfigError:
                continue
            topology = pipeline_topology(layout)
            for axis, kind in (("pipe", "pp"), ("data", "dp"), ("model", "tp")):
                lists = topology.get_axis_comm_lists(axis) or [[r] for r in range(16)]
                assert sorted(lists) == sorted(layout.groups(kind)), (layout.sizes, axis)
            checked += 1
    assert checked > 200


def test_a_topology_that_is_not_the_layout_is_refused():
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from moe_plugin.groups.layout import RankLayout
    from moe_plugin.integration.pipe_topology import check_topology

    layout = RankLayout.build(4, pp=2)   # tp-cp-ep-dp-pp: stages {0, 1} and {2, 3}
    check_topology(ProcessTopology(axes=["pipe", "data"], dims=[2, 2]), layout)   # DeepSpeed's default: the same
    with pytest.raises(ConfigError, match=r"^moe\.parallel\.order: got 'tp-cp-ep-dp-pp'; DeepSpeed's pipeline "
                                          r"topology \(axes \['data', 'pipe'\].* puts rank 1 at pipe 1 but the layout "
                                          r"at pp 0"):
        check_topology(ProcessTopology(axes=["data", "pipe"], dims=[2, 2]), layout)


def test_stage_boundaries_follow_megatron_and_names_map_to_gpt():
    from moe_plugin.integration.pipeline import (
        gpt_state_dict_key,
        pipeline_state_dict_key,
        stage_boundaries,
        stage_layers,
    )

    assert stage_boundaries(_config(pp=2)) == [0, 3, 7]   # [embedding, L0, L1] [L2, L3, norm, output]
    uneven = _config(pp=2)
    uneven.num_layers_in_first_pipeline_stage = 1
    assert [list(r) for r in stage_layers(uneven)] == [[0], [1, 2, 3]]
    assert stage_boundaries(uneven) == [0, 2, 7]
    assert stage_boundaries(_config()) == [0, 7]
    for gpt_key, pipe_key in {"embedding.word_embeddings.weight": "0.embedding.word_embeddings.weight",
                              "decoder.layers.2.mlp.router.weight": "3.layer.mlp.router.weight",
                              "decoder.final_layernorm.weight": "5.final_layernorm.weight",
                              "output_layer.weight": "6.output_layer.weight"}.items():
        assert pipeline_state_dict_key(gpt_key, 4) == pipe_key
        assert gpt_state_dict_key(pipe_key, 4) == gpt_key
    with pytest.raises(KeyError, match="piece 5 is no layer in a pipe of 4 layers"):
        gpt_state_dict_key("5.layer.mlp.router.weight", 4)
