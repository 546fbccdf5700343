"""One model under every layout: the pipeline's stages hold the weights of the one-rank ``GPTModel``.

The oracle is a plain ``GPTModel`` with the plugin's spec on one rank, built right after
``torch.manual_seed(SEED)``, tied (Megatron-LM's default) and untied. Each pipeline layout builds
``gpt_pipeline_module`` under the same seed; every piece, mapped to ``GPTModel`` names and cut to
this rank's shards, must equal the oracle's weights exactly (init is layout independent, not
loaded). Tied: the last stage's output weight equals the first stage's word weight, starts equal
after training steps (the engine sums their gradients), and the one-rank oracle trained on the same
batches gives the same losses.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_distributed
from gpt_tiny import (MODEL, SEQ, VOCAB, global_batch, micro_batches, one_rank_groups, shard_full, torch_steps,
                      transformer_config)
from ds_json import ds_config
from moe_plugin.configs import MoEConfig

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

SEED, B, GAS, STEPS, LR, CLIP = 5, 4, 2, 3, 0.5, 1.0   # CLIP: DeepSpeed's default gradient_clipping
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.0, "layer_interval": 2}
NUM = MODEL["num_layers"]

# name -> world size, moe.parallel
LAYOUTS = {
    "pp2": (2, {"pipeline": 2}),
    "pp2-ep2": (4, {"pipeline": 2, "expert": 2}),
    "tp2-pp2-ep2": (4, {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1}),
}


def _gpt(config, moe_config, groups, tied: bool):
    from megatron.core.models.gpt import GPTModel

    from moe_plugin.integration.megatron import gpt_moe_spec

    torch.manual_seed(SEED)
    return GPTModel(config, gpt_moe_spec(moe_config, config, groups), vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=tied)


def _oracle(rank: int, world_size: int) -> dict:
    out = {}
    with one_rank_groups() as groups:
        for tied in (True, False):
            model = _gpt(transformer_config(MODEL), MoEConfig.from_dict(MOE), groups, tied)
            initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
            batches = [global_batch(step, B) for step in range(STEPS)]   # one replica's whole batch
            losses, _ = torch_steps(model, torch.optim.SGD(model.parameters(), lr=LR), batches, CLIP)
            out[tied] = {"initial": initial, "losses": losses}
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return run_distributed(_oracle, 1, tmp_path_factory.mktemp("oracle"))[0]


def _ds_config(parallel: dict, dp: int) -> dict:
    return ds_config(batch=B, dp=dp, gas=GAS, clip=CLIP, optimizer={"type": "SGD", "params": {"lr": LR}},
                     zero_allow_untested_optimizer=True, moe=MOE, parallel=parallel)


def _layout(rank: int, world_size: int, parallel: dict, oracle: dict) -> dict:
    import moe_plugin
    from moe_plugin.integration.pipeline import gpt_pipeline_module

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    tp, pp = parallel.get("tensor", 1), parallel["pipeline"]
    out = {}
    for tied in (True, False):
        dp = world_size // (tp * pp)

        def provider(moe_config, groups):
            torch.manual_seed(SEED)
            return gpt_pipeline_module(transformer_config(MODEL, tp, pp), moe_config, groups, vocab_size=VOCAB,
                                       max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)

        run = moe_plugin.initialize(_ds_config(parallel, dp), provider)
        try:
            module, groups = run.engine.module, run.groups
            full = oracle[tied]["initial"]
            if tied:   # GPTModel has no output weight of its own: the pipeline's copy is the word weight
                full = {**full, "output_layer.weight": full["embedding.word_embeddings.weight"]}
            expected = shard_full(module, full, groups, pipelined=True, num_layers=NUM)
            mine = module.state_dict()
            mismatched = [k for k, v in mine.items() if torch.is_tensor(v) and k in expected
                          and not torch.equal(v, expected[k])]
            missing = [k for k, v in mine.items() if torch.is_tensor(v) and k not in expected
                       and not k.endswith("_extra_state")]
            dp_rank = groups.rank_in("dp")
            losses = []
            for step in range(STEPS):
                batches = micro_batches(step, B, dp_rank, dp, GAS)
                losses.append(float(run.engine.train_batch(iter(batches))))
            tied_ok = None
            if tied and module.tied_weights:
                weight = module.tied_weights[0][0].detach().clone()
                gathered = [torch.zeros_like(weight) for _ in groups.ranks("embedding")]
                torch.distributed.all_gather(gathered, weight, group=module.tied_weights[0][1])
                tied_ok = all(torch.equal(gathered[0], g) for g in gathered)
            out[tied] = {"mismatched": mismatched, "missing": missing, "losses": losses, "tied_equal": tied_ok,
                         "n_tied": len(module.tied_weights)}
        finally:
            run.close()
    return out


@pytest.fixture(scope="module")
def layouts(oracle, tmp_path_factory):
    return {name: run_distributed(_layout, world, tmp_path_factory.mktemp(name.replace("-", "_")), parallel, oracle)
            for name, (world, parallel) in LAYOUTS.items()}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipeline_stages_hold_the_one_rank_weights(name, tied, layouts, oracle):
    for rank, result in enumerate(layouts[name]):
        got = result[tied]
        assert got["missing"] == [], f"rank {rank}: pieces without a GPTModel counterpart: {got['missing']}"
        assert got["mismatched"] == [], f"rank {rank}: initial weights differ from GPTModel's: {got['mismatched']}"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(oracle[tied]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        if tied and got["n_tied"]:
            assert got["tied_equal"], f"rank {rank}: the tied copies drifted apart"
