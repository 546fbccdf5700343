"""The two GPT-MoE models of ``bench step``: ours, and a twin whose MoE MLPs are DeepSpeed's.

Both are the same Megatron-Core ``GPTModel`` (CPU-friendly spec from ``gpt_moe_spec``, dense
weights from the same seed) trained by a DeepSpeed engine with the same JSON (ZeRO stage, AdamW,
clipping):

* ``build_ours``: ``moe_plugin.initialize`` with the plugin's ``MegatronMoEMLP`` on the MoE
  layers (EP over ``spec.ep`` ranks; the groups are registered with Megatron and DeepSpeed).
* ``build_deepspeed_twin``: the same model built again, each ``MegatronMoEMLP`` replaced by
  ``DeepSpeedMoEMLP``, a Megatron-MLP-shaped wrapper (``forward(x) -> (out, None)``) around
  ``deepspeed.moe.layer.MoE`` made by ``deepspeed_moe.deepspeed_twin``: same experts (copies of
  our weights), top-2 without sampling, capacity factor, min capacity (or dropless). Trained
  through plain ``deepspeed.initialize``; its ``l_aux`` is added to the loss with our ``aux_loss_coeff``.

Groups. DeepSpeed's ``MoE.set_deepspeed_parallelism`` creates an ``ep_size_<n>`` group only when
``deepspeed.utils.groups`` has none of that name. The twin is built *after* ours, whose groups
``initialize`` registered under exactly that name (same rank lists as DeepSpeed's own layout
for TP 1), so the twin reuses our EP and expert-data-parallel groups: the two coexist in one
process. Built the other way round, ``register`` would refuse DeepSpeed's groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTSpec:
    """Sizes of the tiny GPT-MoE (per rank: ``micro_batch`` sequences of ``seq`` tokens)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 1024
    experts: int = 8
    ep: int = 4
    moe_every: int = 2          # layer i is MoE when i % moe_every == 0
    seq: int = 256
    micro_batch: int = 4
    vocab: int = 4096
    k: int = 2
    capacity_factor: float = 1.25
    min_capacity: int = 4
    dropless: bool = False      # no capacity (DeepSpeed: every expert padded to the largest load)
    aux_loss_coeff: float = 1e-2
    zero_stage: int = 1
    lr: float = 1e-4
    seed: int = 0
    device: str = "cpu"         # where DeepSpeed's engine puts the model: its accelerator's device
    dtype: str = "fp32"         # fp32, or bf16 / fp16: DeepSpeed's "bf16" / "fp16" block

    def moe_block(self) -> dict:
        from moe_plugin_tools.bench.deepspeed_moe import routing_fields

        if self.k not in (1, 2):
            raise ValueError(f"bench step compares top-1 or top-2 routing (DeepSpeed's MoE gates), got k={self.k}")
        block = {"num_experts": self.experts, **routing_fields(self.k, self.dropless, self.capacity_factor),
                 "activation": "gelu", "aux_loss_coeff": self.aux_loss_coeff, "layer_interval": self.moe_every,
                 "parallel": {"expert": self.ep}}
        if not self.dropless:      # dropless has no capacity: the block leaves its fields out
            block["min_capacity"] = self.min_capacity
        return block

    def ds_config(self, world_size: int, moe: bool = True) -> dict:
        """The DeepSpeed JSON both engines get (the twin's without the ``"moe"`` block)."""
        config = {"train_batch_size": self.micro_batch * world_size, "train_micro_batch_size_per_gpu": self.micro_batch,
                  "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
                  # torch's AdamW: DeepSpeed's FusedAdam would JIT-compile an op on CPU
                  "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.1, "torch_adam": True}},
                  "zero_optimization": {"stage": self.zero_stage}}
        if self.dtype != "fp32":
            config["bf16" if self.dtype == "bf16" else "fp16"] = {"enabled": True}
        if moe:
            config["moe"] = self.moe_block()
        return config

    def transformer_config(self) -> Any:
        from megatron.core.transformer import TransformerConfig

        from moe_plugin_tools.bench.device import DTYPES

        return TransformerConfig(bf16=self.dtype == "bf16", fp16=self.dtype == "fp16", params_dtype=DTYPES[self.dtype],
                                 num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                                 ffn_hidden_size=self.ffn, use_cpu_initialization=True, hidden_dropout=0.0,
                                 attention_dropout=0.0, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                 masked_softmax_fusion=False, apply_rope_fusion=False)


def gpt_model(spec: GPTSpec, moe_config: Any, groups: Any) -> nn.Module:
    """The GPTModel with the plugin's MoE MLPs; the dense init is seeded, so two calls agree."""
    from megatron.core.models.gpt import GPTModel

    from moe_plugin.integration.megatron import gpt_moe_spec

    config = spec.transformer_config()
    torch.manual_seed(spec.seed)   # Megatron's dense init draws from the default generator
    return GPTModel(config, gpt_moe_spec(moe_config, config, groups, seed=spec.seed, cpu=True),
                    vocab_size=spec.vocab, max_sequence_length=spec.seq)


def build_ours(spec: GPTSpec, world_size: int) -> Any:
    """``moe_plugin.initialize`` of the GPT-MoE; returns its ``Initialized`` (close() it)."""
    import moe_plugin

    return moe_plugin.initialize(spec.ds_config(world_size), lambda moe_config, groups: gpt_model(spec, moe_config,
                                                                                                  groups))


class DeepSpeedMoEMLP(nn.Module):
    """``deepspeed.moe.layer.MoE`` where Megatron expects an MLP: ``forward(x_SBH) -> (out, None)``.
    ``l_aux`` keeps the balance loss of the latest forward (before the coefficient)."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.l_aux: Optional[Tensor] = None

    def forward(self, hidden_SBH: Tensor, padding_mask: Optional[Tensor] = None) -> tuple[Tensor, None]:
        if padding_mask is not None:
            raise NotImplementedError("DeepSpeedMoEMLP routes every token; padding_mask is not supported")
        out_SBH, self.l_aux, _ = self.moe(hidden_SBH)
        return out_SBH, None


def build_deepspeed_twin(spec: GPTSpec, ours: Any, world_size: int) -> tuple[Any, list[DeepSpeedMoEMLP]]:
    """The same GPT with DeepSpeed's MoE layers, in plain ``deepspeed.initialize``. Call after
    ``build_ours`` (see the module docstring). Returns the engine and the MoE wrappers."""
    import deepspeed

    from moe_plugin_tools.bench.deepspeed_moe import deepspeed_twin
    from moe_plugin.integration.megatron import MegatronMoEMLP

    model = gpt_model(spec, ours.moe_config, ours.groups)
    wrappers = []
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MegatronMoEMLP):
            layer.mlp = DeepSpeedMoEMLP(deepspeed_twin(layer.mlp, spec.ep, set_parallelism=False))
            wrappers.append(layer.mlp)
    if not wrappers:
        raise ValueError(f"no MoE layer among {spec.layers} layers with moe_every={spec.moe_every}")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=spec.ds_config(world_size, moe=False))
    if not engine.has_moe_layers:
        raise RuntimeError("DeepSpeed's engine did not find the twin's MoE layers")
    for w in wrappers:
        group = w.moe.deepspeed_moe.ep_group
        if spec.ep > 1 and group is not ours.groups.ep:
            raise RuntimeError(f"the twin's expert-parallel group is not the plugin's ep_size_{spec.ep} group "
                               f"(ranks {dist.get_process_group_ranks(group) if group is not None else None})")
    return engine, wrappers


def twin_aux_loss(spec: GPTSpec, wrappers: list[DeepSpeedMoEMLP]) -> Tensor:
    """``aux_loss_coeff * sum of l_aux`` of the twin's latest forward (ours attaches it itself)."""
    return spec.aux_loss_coeff * torch.stack([w.l_aux for w in wrappers]).sum()


def same_weights(ours_engine: Any, twin_engine: Any) -> bool:
    """Whether every parameter the two models share by name (all but the MoE MLPs') is equal."""
    theirs = dict(twin_engine.module.named_parameters())
    shared = [(n, p) for n, p in ours_engine.module.named_parameters() if n in theirs]
    return bool(shared) and all(torch.equal(p, theirs[n]) for n, p in shared)


__all__ = ["DeepSpeedMoEMLP", "GPTSpec", "build_deepspeed_twin", "build_ours", "gpt_model", "same_weights",
           "twin_aux_loss"]
