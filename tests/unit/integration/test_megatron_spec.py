"""Megatron-Core GPT with the plugin's MoE spec, on CPU.

* spec level (no process): what ``moe_layer_spec`` / ``cpu_friendly_spec`` accept and swap;
* one rank: which layers are MoE (interval, explicit list, Megatron-LM's ``--spec`` import),
  parameter names, a finite loss, the aux loss reaching ``router.weight.grad``;
* two ranks (one spawn): TP 2 (expert TP 2), TP 2 with sequence parallelism, EP 2, and TP 2 x
  EP 2 folded against the single-process model loaded with the same weights (logits, loss and
  every gradient, per shard); the global layer index on a second pipeline stage; Megatron-LM's
  flow (Megatron's own ``initialize_model_parallel``, groups checked against it).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_plugin.configs import ConfigError, MoEConfig

VOCAB, SEQ, BATCH = 64, 8, 2
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32; tensor parallelism only reorders sums


# --- helpers run inside the ranks --------------------------------------------------------------
def _config(tp: int = 1, pp: int = 1, sp: bool = False, **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{**MODEL, "attention_dropout": 0.0, **overrides}, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, sequence_parallel=sp, use_cpu_initialization=True,
                             hidden_dropout=0.0, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                             masked_softmax_fusion=False, apply_rope_fusion=False)


def _groups(world_size: int, **sizes):
    from moe_plugin.groups import RankLayout, build_process_groups, register

    groups = build_process_groups(RankLayout.build(world_size, **sizes))
    register(groups)
    return groups


def _drop(groups) -> None:
    from moe_plugin.groups import destroy_process_groups, unregister

    unregister()
    destroy_process_groups(groups)


def _gpt(spec, config, pre_process: bool = True, post_process: bool = True):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1234)  # Megatron's dense init draws from the default generator
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
                    post_process=post_process)


def _batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), labels


def _moe_indices(model) -> list:
    return [layer.moe_layer_index for layer in model.decoder.layers]


def _train_step(model, groups=None) -> dict:
    """Logits (one forward), then loss and gradients (a second forward and backward)."""
    from moe_plugin.integration.sp_grads import allreduce_sequence_parallel_grads

    ids, pos, labels = _batch()
    logits = model(ids, pos, None)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model, groups)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


# --- spec level --------------------------------------------------------------------------------
def test_spec_transformations_keep_the_kind_and_swap_only_the_cpu_pieces():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron.core.transformer.identity_op import IdentityOp

    from moe_plugin.integration.cpu_modules import SDPAttention, TorchNorm
    from moe_plugin.integration.megatron import MoEAwareTransformerLayer, cpu_friendly_spec, moe_layer_spec

    moe = MoEConfig.from_dict({"num_experts": 4})
    base = get_gpt_layer_local_spec()
    layer = moe_layer_spec(base, moe)
    assert layer.module is MoEAwareTransformerLayer and layer.params["moe"].moe_config is moe
    assert layer.submodules.mlp.module is MLP  # dense stays; the layer picks MoE at build time
    assert moe_layer_spec(layer, moe).module is MoEAwareTransformerLayer  # idempotent

    block = cpu_friendly_spec(moe_layer_spec(TransformerBlockSubmodules([base] * 3, WrappedTorchNorm), moe))
    assert isinstance(block, TransformerBlockSubmodules) and block.layer_norm is TorchNorm
    for spec in block.layer_specs:
        sub = spec.submodules
        assert sub.self_attention.submodules.core_attention is SDPAttention
        assert sub.input_layernorm is TorchNorm and sub.pre_mlp_layernorm is TorchNorm
        assert sub.self_attention.submodules.linear_qkv is base.submodules.self_attention.submodules.linear_qkv
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention  # not mutated

    # Multi-latent attention (--multi-latent-attention, also through Megatron-LM's --spec): Megatron's
    # MLASelfAttention as compat/megatron_mla builds it, SDPA core attention on every device, torch latent norms.
    from moe_plugin.compat.megatron_mla import MLAttention
    from moe_plugin.integration.megatron import mla_layer_spec

    mla = mla_layer_spec("RMSNorm", qk_layernorm=True).submodules.self_attention
    assert mla.module is MLAttention and mla.submodules.core_attention is SDPAttention
    assert mla.submodules.q_layernorm is TorchNorm and mla.submodules.kv_layernorm is TorchNorm
    assert mla_layer_spec("RMSNorm", qk_layernorm=False).submodules.self_attention.submodules.kv_layernorm is IdentityOp

    # MoE layers get a norm of their own only where the dense MLP's fc1 applies the pre-MLP norm (TE).

    from moe_plugin.integration.megatron import MoEPlan, _with_moe_mlp

    fused_fc1 = type("TELayerNormColumnParallelLinear", (), {})
    sub = base.submodules
    fused = dataclasses.replace(sub, pre_mlp_layernorm=IdentityOp, mlp=dataclasses.replace(
        sub.mlp, submodules=dataclasses.replace(sub.mlp.submodules, linear_fc1=fused_fc1)))
    assert _with_moe_mlp(fused, MoEPlan(moe), 0).pre_mlp_layernorm is TorchNorm
    no_norm = dataclasses.replace(sub, pre_mlp_layernorm=IdentityOp)
    assert _with_moe_mlp(no_norm, MoEPlan(moe), 0).pre_mlp_layernorm is IdentityOp
    assert _with_moe_mlp(sub, MoEPlan(moe), 0).pre_mlp_layernorm is sub.pre_mlp_layernorm

    # The "moe" block must agree with the TransformerConfig (checked again by every layer).
    from moe_plugin.integration.megatron import check_against_model

    with pytest.raises(ConfigError, match=r"moe\.parallel\.tensor: got 2; the Megatron TransformerConfig has "
                                          r"tensor_model_parallel_size=1"):
        check_against_model(MoEConfig.from_dict({"num_experts": 4, "parallel": {"tensor": 2}}), _config())
    recompute = _config(recompute_granularity="selective", recompute_modules=["mlp"])
    with pytest.raises(ConfigError, match=r"moe\.second_expert_policy: got 'random'; must be 'all' with Megatron's"):
        check_against_model(moe, recompute)
    check_against_model(MoEConfig.from_dict({"num_experts": 4, "second_expert_policy": "all"}), recompute)
    with pytest.raises(ConfigError, match=r"moe\.aux_loss_scope: got 'global'; cannot be used with Megatron's "
                                          r"activation recomputation of the MLP"):
        check_against_model(MoEConfig.from_dict({"num_experts": 4, "second_expert_policy": "all",
                                                 "aux_loss_scope": "global"}), recompute)

    # Grouped-query attention: each TP rank holds whole query groups.
    with pytest.raises(ConfigError, match=r"^moe\.parallel\.tensor: got 2; must divide the TransformerConfig's "
                                          r"num_query_groups \(1\)"):
        check_against_model(MoEConfig.from_dict({"num_experts": 4, "parallel": {"tensor": 2}}),
                            _config(tp=2, num_query_groups=1))

    # QK-norm: the norm of the config, marked for the sum over TP (each rank normalises its own heads).
    from moe_plugin.integration.cpu_modules import TorchQKNorm
    from moe_plugin.integration.megatron import gpt_moe_spec

    llama = _config(normalization="RMSNorm", qk_layernorm=True)
    attention = gpt_moe_spec(moe, llama, cpu=True, pp_rank=0).layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm is TorchQKNorm and attention.k_layernorm is TorchQKNorm
    norm = TorchQKNorm(llama, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6 and norm.weight.sequence_parallel

    with pytest.raises(TypeError, match="ModuleSpec of TransformerLayer"):
        moe_layer_spec(base.submodules.self_attention, moe)
    with pytest.raises(ValueError, match="build the base spec dense"):
        moe_layer_spec(get_gpt_layer_local_spec(num_experts=4), moe)


# --- one rank ----------------------------------------------------------------------------------
def _single_rank(rank: int, world_size: int, ds_config_path: str) -> dict:
    import os

    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import import_module

    from moe_plugin.integration.megatron import MegatronMoEMLP, gpt_moe_spec

    groups = _groups(world_size)
    out: dict = {}
    config = _config()
    for name, block in {"interval": {"layer_interval": 2}, "list": {"layers": [1, 2]}}.items():
        moe = MoEConfig.from_dict({"num_experts": 4, **block})
        model = _gpt(gpt_moe_spec(moe, config, groups), config)
        kinds = [type(layer.mlp) for layer in model.decoder.layers]
        assert all(k in (MegatronMoEMLP, MLP) for k in kinds), kinds
        out[name] = {"moe": _moe_indices(model), "names": [n for n, _ in model.named_parameters()]}

    # Loss and gradients; then the aux loss alone (main loss x 0) reaches the routers, scaled by its coefficient.
    moe = MoEConfig.from_dict({"num_experts": 4, "layer_interval": 2, "aux_loss_coeff": 0.01})
    model = _gpt(gpt_moe_spec(moe, config, groups), config)
    step = _train_step(model)
    out["loss"] = step["loss"]
    out["router_grad"] = step["grads"]["decoder.layers.0.mlp.router.weight"]
    aux_only = {}
    for coeff in (0.01, 0.02):
        twin = _gpt(gpt_moe_spec(moe.model_copy(update={"aux_loss_coeff": coeff}), config, groups), config)
        twin.load_state_dict(model.state_dict())
        ids, pos, labels = _batch()
        (twin(ids, pos, None, labels=labels).float().mean() * 0.0).backward()
        aux_only[coeff] = {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}
    out["aux_only"] = aux_only

    with pytest.raises(ConfigError, match=r"moe\.layers: got \[1, 4\]; the model has 4 layers"):
        gpt_moe_spec(MoEConfig.from_dict({"num_experts": 4, "layers": [1, 4]}), config, groups)

    out["attention"] = _attention_vs_megatron()
    out["attention_dropout"] = _attention_dropout()

    # Megatron-LM: --spec MODULE NAME is resolved by Megatron's own import_module.
    os.environ["MOE_PLUGIN_DS_CONFIG"] = ds_config_path
    spec = import_module(("moe_plugin.integration.megatron_lm_spec", "spec"))
    out["megatron_lm"] = _moe_indices(_gpt(spec, config))
    _drop(groups)
    return out


def _attention_vs_megatron() -> dict:
    """SDPAttention against Megatron's DotProductAttention (GQA; causal without a mask, an
    explicit causal mask, a causal mask with padded keys), forward and input gradients."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe_plugin.integration.cpu_modules import SDPAttention

    # DotProductAttention takes its score buffer on torch.cuda.current_device() and forks the RNG
    # tracker for dropout: seed_megatron_rng, what a script that builds its model itself calls, gives
    # both their CPU stand-ins. Its own causal mask is built on "cuda", so it always gets explicit masks.
    from moe_plugin.integration.seeding import seed_megatron_rng

    seed_megatron_rng(0, None)
    config = _config(num_query_groups=2, apply_query_key_layer_scaling=True)
    args = dict(config=config, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")
    theirs, mine = DotProductAttention(**args), SDPAttention(**args)
    gen = torch.Generator().manual_seed(3)
    qkv = [torch.randn(SEQ, BATCH, heads, 8, generator=gen, requires_grad=True) for heads in (4, 2, 2)]
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    padded = causal | (torch.arange(SEQ) >= SEQ - 2)[None, None, None, :]  # last two keys are padding
    diffs = {}
    for name, (their_mask, my_mask) in {"causal": (causal, None), "causal mask": (causal, causal),
                                        "padded": (padded, padded)}.items():
        ref = theirs(*qkv, their_mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), qkv)
        got = mine(*qkv, my_mask)
        got_grads = torch.autograd.grad(got.square().sum(), qkv)
        diffs[name] = max([(got - ref).abs().max()] + [(a - b).abs().max() for a, b in zip(got_grads, ref_grads)])
    return diffs


def _attention_dropout() -> dict:
    """SDPAttention's dropout draws inside Megatron's RNG tracker's model-parallel state (as
    DotProductAttention's): the same seed and tp rank give the same output, another tp rank another,
    torch's default generator is where it was."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    from moe_plugin.integration.cpu_modules import SDPAttention

    attention = SDPAttention(_config(attention_dropout=0.5), layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self").train()
    qkv = [torch.randn(SEQ, BATCH, 4, 8, generator=torch.Generator().manual_seed(4)) for _ in range(3)]
    outs, before = [], torch.get_rng_state()
    for tp_rank in (0, 0, 1):   # the tracker seed_megatron_rng installed, seeded as that tp rank's
        model_parallel_cuda_manual_seed(5, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        outs.append(attention(*qkv, None))
    return {"same": torch.equal(outs[0], outs[1]), "other_tp_rank_differs": not torch.equal(outs[0], outs[2]),
            "default_untouched": torch.equal(before, torch.get_rng_state())}


@pytest.mark.slow
def test_one_rank_moe_layers_names_loss_and_aux_loss(dist_run, tmp_path):
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_batch_size": 2, "moe": {"num_experts": 4, "layers": [3]}}))
    out = dist_run(_single_rank, 1, str(ds_config))[0]

    assert out["interval"]["moe"] == [0, None, 2, None]
    assert out["list"]["moe"] == [None, 1, 2, None]
    assert out["megatron_lm"] == [None, None, None, 3]
    names = out["interval"]["names"]
    for expected in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.weight1",
                     "decoder.layers.0.mlp.experts.weight2", "decoder.layers.1.mlp.linear_fc1.weight",
                     "decoder.layers.2.mlp.router.weight", "decoder.layers.3.mlp.linear_fc2.weight"):
        assert expected in names, expected
    assert not any(n.startswith("decoder.layers.1.mlp.router") for n in names)

    assert all(d < 1e-5 for d in out["attention"].values()), out["attention"]
    assert out["attention_dropout"] == {"same": True, "other_tp_rank_differs": True, "default_untouched": True}
    assert torch.isfinite(out["loss"]) and 3.0 < out["loss"] < 6.0  # ~ln(64) at init
    assert torch.isfinite(out["router_grad"]).all() and out["router_grad"].abs().sum() > 0
    # With the main loss multiplied by 0 every gradient is the aux loss's: linear in its coefficient,
    # non-zero on the routers, zero on what no router depends on (after the last router: layer 2's
    # experts, layer 3, the final norm).
    small, large = out["aux_only"][0.01], out["aux_only"][0.02]
    for name in small:
        torch.testing.assert_close(large[name], 2 * small[name], msg=name)
    routers = [n for n in small if n.endswith("mlp.router.weight")]
    assert routers == ["decoder.layers.0.mlp.router.weight", "decoder.layers.2.mlp.router.weight"]
    assert all(small[n].abs().sum() > 0 for n in routers)
    untouched = [n for n in small if n.startswith(("decoder.layers.2.mlp.experts.", "decoder.layers.3.",
                                                   "decoder.final_layernorm"))]
    assert untouched and all(small[n].abs().sum() == 0 for n in untouched)


# --- two ranks ---------------------------------------------------------------------------------
# Routing that does not depend on how tokens are split over ranks: dropless, no random routing,
# no balance loss (each rank's tokens are one GShard group, so capacity and the balance loss are
# per rank by design); the z-loss is a mean over tokens and splits exactly.
ROUTING = {"num_experts": 4, "drop_tokens": False, "aux_loss_coeff": 0.0, "z_loss_coeff": 1e-3}
CASES = {  # name -> (layout sizes, sequence parallel, "moe" block without "parallel", TransformerConfig extras)
    # Expert TP = TP: expert FFNs split over the TP pair (swiglu: gate and up halves); GQA attention.
    "tp2": (dict(tp=2), False, {**ROUTING, "layer_interval": 2, "router": "gshard", "second_expert_policy": "all",
                                "activation": "swiglu"}, dict(num_query_groups=2)),
    # Sequence parallel; Megatron's dense MLP gated (its fc1 is a stride-2 column-parallel shard).
    "tp2-sp": (dict(tp=2), True, {**ROUTING, "layers": [1, 2], "router": "topk", "top_k": 2},
               dict(gated_linear_unit=True)),
    # Expert parallel over the two data-parallel ranks (both get the same batch here).
    "ep2": (dict(ep=2), False, {**ROUTING, "layer_interval": 2, "router": "switch"}, {}),
    # MoE parallel folding: EP carved out of the TP pair, experts whole (etp 1).
    "tp2-ep2-folded": (dict(tp=2, ep=2, etp=1), False, {**ROUTING, "layers": [0, 3], "router": "topk", "top_k": 2},
                       {}),
}


def _reduce_like_deepspeed(model, groups) -> None:
    """Average dense gradients over dp and expert ones (``allreduce = False``) over edp."""
    import torch.distributed as dist

    for param in model.parameters():
        kind = "dp" if getattr(param, "allreduce", True) else "edp"
        if param.grad is not None and groups.group(kind) is not None:
            dist.all_reduce(param.grad, group=groups.group(kind))
            param.grad /= groups.size(kind)


def _two_ranks(rank: int, world_size: int, tp2_json: str, tp1_json: str) -> dict:
    import os

    from megatron.core import parallel_state

    from moe_plugin.groups import destroy_process_groups
    from moe_plugin.integration.megatron import gpt_moe_spec, megatron_lm_spec
    from moe_plugin.integration.seeding import seed_megatron_rng
    from moe_plugin.checkpoint.reshard import shard_state_dict

    out: dict = {}
    for name, (sizes, sp, block, extras) in CASES.items():
        groups = _groups(world_size)  # tp 1, dp 2: each rank runs the single-process model
        ref_config = _config(**extras)
        ref_model = _gpt(gpt_moe_spec(MoEConfig.from_dict(block), ref_config, groups), ref_config)
        full_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref_model.state_dict().items()}
        ref = _train_step(ref_model, groups)
        _drop(groups)

        groups = _groups(world_size, **sizes)
        s = groups.layout.sizes
        moe = MoEConfig.from_dict({**block, "parallel": {"tensor": s.tp, "expert": s.ep, "expert_tensor": s.etp,
                                                         "sequence_parallel": sp}})
        config = _config(tp=s.tp, sp=sp, **extras)
        seed_megatron_rng(0, groups)   # what a script that builds its model itself calls (README)
        model = _gpt(gpt_moe_spec(moe, config, groups), config)
        model.load_state_dict(shard_state_dict(full_state, model, groups.layout, rank))
        got = _train_step(model, groups)
        _reduce_like_deepspeed(model, groups)
        got["grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        tp_rank, vocab = groups.rank_in("tp"), VOCAB // s.tp
        out[name] = {"ref_loss": ref["loss"], "loss": got["loss"],
                     "ref_logits": ref["logits"][..., tp_rank * vocab:(tp_rank + 1) * vocab], "logits": got["logits"],
                     "ref_grads": shard_state_dict(ref["grads"], model, groups.layout, rank, strict=False), "grads": got["grads"],
                     "kept": [layer.mlp.last_stats.kept_per_expert for layer in model.decoder.layers
                              if layer.moe_layer_index is not None]}
        _drop(groups)

    # Pipeline stage 2 of 2 holds global layers 2 and 3: MoE where the global index says, with the
    # weights the single-process model gives that layer.
    groups = _groups(world_size, pp=2)
    moe = MoEConfig.from_dict({"num_experts": 4, "layer_interval": 2, "parallel": {"pipeline": 2}})
    config = _config(pp=2, pipeline_dtype=torch.float32)
    stage = _gpt(gpt_moe_spec(moe, config, groups, seed=0), config, pre_process=rank == 0, post_process=rank == 1)
    out["pp"] = {"moe": _moe_indices(stage),
                 "router": {layer.moe_layer_index: layer.mlp.router.weight.detach().clone()
                            for layer in stage.decoder.layers if layer.moe_layer_index is not None}}
    _drop(groups)

    # Megatron-LM's flow: Megatron owns parallel_state (initialize_model_parallel); the spec builds
    # the plugin's groups from the DeepSpeed JSON and checks that they are Megatron's.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    os.environ["MOE_PLUGIN_DS_CONFIG"] = tp2_json
    spec = megatron_lm_spec()
    model = _gpt(spec, _config(tp=2))
    out["megatron_lm"] = {"moe": _moe_indices(model), "loss": _train_step(model)["loss"]}
    os.environ["MOE_PLUGIN_DS_CONFIG"] = tp1_json
    with pytest.raises(ConfigError, match=r"moe\.parallel\.tensor: .* the tp group \[\d\] but Megatron's is \[0, 1\]"):
        megatron_lm_spec()
    parallel_state.destroy_model_parallel()
    destroy_process_groups(spec.params["moe"].groups)
    return out


@pytest.mark.slow
def test_two_ranks_parallel_matches_single_process_pipeline_offsets_megatron_lm(dist_run, tmp_path):
    paths = []
    for tp in (2, 1):
        path = tmp_path / f"ds_tp{tp}.json"
        path.write_text(json.dumps({"moe": {"num_experts": 4, "layers": [1], "parallel": {"tensor": tp}}}))
        paths.append(str(path))
    results = dist_run(_two_ranks, 2, *paths)
    for rank, out in enumerate(results):
        for case in CASES:
            res = out[case]
            where = f"rank {rank}, {case}"
            torch.testing.assert_close(res["loss"], res["ref_loss"], **TOL, msg=f"{where}: loss")
            torch.testing.assert_close(res["logits"], res["ref_logits"], **TOL, msg=f"{where}: logits")
            assert set(res["grads"]) == set(res["ref_grads"]), where
            for name, grad in res["grads"].items():
                torch.testing.assert_close(grad, res["ref_grads"][name], **TOL, msg=f"{where}: grad {name}")
            assert len(res["kept"]) == 2 and all(k.sum() > 0 for k in res["kept"]), where

    assert [out["pp"]["moe"] for out in results] == [[0, None], [2, None]]
    # Same seed mixing on every layout: layer 2's router on stage 2 equals a one-stage model's layer 2.
    from moe_plugin.layers.router import Router

    moe = MoEConfig.from_dict({"num_experts": 4, "layer_interval": 2})
    for rank, index in ((0, 0), (1, 2)):
        expected = Router(moe, MODEL["hidden_size"], seed=index, init_std=0.02).weight
        torch.testing.assert_close(results[rank]["pp"]["router"][index], expected)

    for out in results:
        assert out["megatron_lm"]["moe"] == [None, 1, None, None]
        assert torch.isfinite(out["megatron_lm"]["loss"])
