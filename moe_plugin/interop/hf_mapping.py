"""The rules of one model between the Hugging Face tensor names and the plugin's ``GPTModel``.

``HFMapping(arch)`` lists a ``Rule`` per plugin tensor: the embedding, each layer's norms, its attention,
its dense or MoE MLP (the blocks its family declares, ``interop/families/``), the final norm and the
output layer; and the plugin's own entries that have no HF tensor. The tables: docs/huggingface.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_plugin.interop.families.blocks import Fns, Rule, copy
from moe_plugin.interop.hf_arch import HFArchitecture

MLP_EXTRA_STATE = ("mlp.linear_fc1", "mlp.linear_fc2")   # Megatron's linears carry a (None) _extra_state


class HFMapping:
    """The rules of one model (``arch``), and the plugin-only entries it adds."""

    def __init__(self, arch: HFArchitecture):
        self.arch = arch
        self.family = arch.family
        self.rules: list[Rule] = []
        self.add("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], copy())
        for i in range(arch.num_layers):
            p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            self.add(p + "input_layernorm.weight", [h + "input_layernorm.weight"], copy())
            self.family.attention.rules(self, arch, p, h)
            self.add(p + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], copy())
            mlp = self.family.mlp if i in arch.moe_layers else self.family.dense_mlp
            mlp.rules(self, arch, p, h)
        self.add("decoder.final_layernorm.weight", ["model.norm.weight"], copy())
        if not arch.tied:
            self.add("output_layer.weight", ["lm_head.weight"], copy())

    def add(self, plugin: str, hf: list[str], fns: Fns, expert: Optional[int] = None,
            hf_row: Optional[int] = None) -> None:
        self.rules.append(Rule(plugin, tuple(hf), *fns, expert=expert, hf_row=hf_row))

    def plugin_only(self) -> dict:
        """The plugin's entries with no HF tensor: router biases (zeros), static placements, ``_extra_state``."""
        a, out = self.arch, {}
        attention = self.family.attention.modules(a)
        for i in range(a.num_layers):
            p = f"decoder.layers.{i}."
            for module in attention + (() if i in a.moe_layers else MLP_EXTRA_STATE):
                out[p + module + "._extra_state"] = None
            if i in a.moe_layers:
                if not self.family.has_correction_bias:
                    out[p + "mlp.router.expert_bias"] = torch.zeros(a.num_experts)
                out[p + "mlp.experts.placement"] = torch.arange(a.num_experts)
        out["output_layer._extra_state"] = None
        return out

    def hf_keys(self) -> set[str]:
        return {k for r in self.rules for k in r.hf}
