"""Tensor names and layouts: a Hugging Face Llama-style decoder and the plugin's ``GPTModel``.

One table per architecture family (the MLP part; the attention, norms and embeddings are the
Llama layout every family shares), and ``HFMapping``: the list of ``Rule``s of one model, each a
plugin state-dict key made from one or more HF tensors by an exact join (concatenation, stacking,
transposition, interleaving: no arithmetic), and cut back by its inverse, so HF -> plugin -> HF is
bit-identical.

    HF (transformers 5.24 save_pretrained)            plugin (GPTModel, 1 rank)
    model.embed_tokens.weight [V, H]                  embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight             decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight      decoder.layers.N.self_attention.linear_qkv.weight
        (and .bias with QKV bias)                         [G * (Q/G + 2) * D, H]: per query group g, its
                                                          Q/G query heads, then its key, then its value head
    model.layers.N.self_attn.o_proj.weight            ...self_attention.linear_proj.weight
    model.layers.N.self_attn.{q,k}_norm.weight        ...self_attention.{q,k}_layernorm.weight ([D] per head;
                                                      OLMoE's [heads*D] over the whole projection)
    model.layers.N.post_attention_layernorm.weight    ...pre_mlp_layernorm.weight
    model.layers.N.mlp.{gate,up,down}_proj.weight     ...mlp.linear_fc1.weight [2F, H] (gate rows, then up),
                                                      ...mlp.linear_fc2.weight [H, F]
    MoE layer, expert e (gate, up, down)              ...mlp.experts.weight1 [E, H, 2F]: [e] = cat(gate, up).T
                                                      ...mlp.experts.weight2 [E, F, H]: [e] = down.T
                                                      (a rule per expert: ``Rule.expert`` e makes row e)
    MoE router (gate.weight [E, H])                   ...mlp.router.weight
    Qwen2-MoE shared_expert.{gate,up,down}_proj       ...mlp.shared_expert.weight1 [H, 2F], weight2 [F, H]
    Qwen2-MoE shared_expert_gate.weight [1, H]        ...mlp.shared_expert.gate_weight [H]
    GLM-4.5 shared_experts.{gate,up,down}_proj        ...mlp.shared_expert.weight1, weight2 (no gate)
    GLM-4.5 gate.e_score_correction_bias [E]          ...mlp.router.expert_bias (fp32)
    DeepSeek-V2/V3 multi-latent attention (self_attn.) self_attention. (Megatron's MLASelfAttention)
        q_proj (V2-Lite: no q_lora_rank)              linear_q_proj.weight
        q_a_proj, q_a_layernorm, q_b_proj             linear_q_down_proj, q_layernorm, linear_q_up_proj
        kv_a_proj_with_mqa [kv_lora + rope, H]        linear_kv_down_proj.weight
        kv_a_layernorm, kv_b_proj, o_proj             kv_layernorm, linear_kv_up_proj, linear_proj
        (Megatron's MLA rotates DeepSeek's interleaved pairs (0, 1), (2, 3) ... as the hub's weights hold
        them; a DeepSeek-V3 with rope_interleave false rotates the pairs (i, i + r/2): its rotated rows of
        q_b_proj / q_proj (each head's last r) and kv_a_proj_with_mqa (the last r) are interleaved at
        import and cut back on export)
    DeepSeek-V3 / V2 shared_experts, gate(.e_score_correction_bias)   as GLM-4.5's
    GPT-OSS self_attn.{q,k,v,o}_proj.bias             ...linear_qkv.bias, ...linear_proj.bias
    GPT-OSS self_attn.sinks [heads]                   ...self_attention.core_attention.softmax_offset
    GPT-OSS mlp.router.{weight,bias}                  ...mlp.router.weight, ...mlp.router.bias
    GPT-OSS fused experts (one tensor per layer):     (a rule per expert: ``Rule.hf_row`` e reads row e)
        mlp.experts.gate_up_proj [E, H, 2F]           ...mlp.experts.weight1: [e] = gate columns (0, 2, 4 ...)
            (gate and up interleaved)                     then up columns (1, 3, 5 ...)
        mlp.experts.gate_up_proj_bias [E, 2F]         ...mlp.experts.bias1, the same order
        mlp.experts.down_proj [E, F, H]               ...mlp.experts.weight2 (the plugin's layout)
        mlp.experts.down_proj_bias [E, H]             ...mlp.experts.bias2
    model.norm.weight                                 decoder.final_layernorm.weight
    lm_head.weight (untied)                           output_layer.weight

Mixtral's MoE block is ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
Qwen's and OLMoE's is ``mlp`` with ``gate_proj``, ``up_proj``, ``down_proj``. The plugin's own entries
(``router.expert_bias`` zeros, ``experts.placement`` the identity, Megatron linears' ``_extra_state``)
have no HF tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from moe_plugin.checkpoint.shards import cat, stack
from moe_plugin.interop.hf_arch import HFArchitecture


@dataclass(frozen=True)
class Family:
    """The MoE MLP's names of one architecture family (HF side, under ``model.layers.N.``)."""

    moe_block: str                  # the MLP module of an MoE layer
    expert: tuple[str, str, str]    # gate, up, down projection of expert e: "experts.{e}.<name>.weight"
    router: str = "gate"
    shared: Optional[tuple[str, str, str]] = None   # shared expert projections
    shared_gate: Optional[str] = None
    shared_module: str = "shared_expert"            # the shared expert's module (GLM-4.5: shared_experts)
    router_bias: Optional[str] = None               # the router's correction bias (GLM-4.5: e_score_correction_bias)
    fused: bool = False   # the experts as 3-D tensors (GPT-OSS): expert = (gate_up_proj, None, down_proj), biases


DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {
    "mixtral": Family("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": Family("mlp", DENSE_MLP),
    "qwen2_moe": Family("mlp", DENSE_MLP, shared=DENSE_MLP, shared_gate="shared_expert_gate"),
    "olmoe": Family("mlp", DENSE_MLP),
    "glm4_moe": Family("mlp", DENSE_MLP, shared=DENSE_MLP, shared_module="shared_experts",
                       router_bias="e_score_correction_bias"),
    "deepseek_v3": Family("mlp", DENSE_MLP, shared=DENSE_MLP, shared_module="shared_experts",
                          router_bias="e_score_correction_bias"),
    "deepseek_v2": Family("mlp", DENSE_MLP, shared=DENSE_MLP, shared_module="shared_experts"),
    "gpt_oss": Family("mlp", ("gate_up_proj", "", "down_proj"), router="router", fused=True),
}
# Megatron's linear layers carry a (None) ``_extra_state`` entry in their state dict.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
MLA_LINEARS = ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")   # with linear_q_proj or the q pair


@dataclass(frozen=True)
class Rule:
    """``plugin`` (its row ``expert`` of an expert weight [E, ...]) = ``join``(the ``hf`` tensors);
    ``cut`` gives them back. Both are exact and work on shapes alone (meta tensors): a conversion
    plans its files from the headers before it reads a tensor."""

    plugin: str
    hf: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    cut: Callable[[Tensor], list[Tensor]]
    expert: Optional[int] = None
    hf_row: Optional[int] = None   # the HF tensors are fused [E, ...]: the rule joins their row ``hf_row``


def _copy() -> tuple[Callable, Callable]:
    return (lambda ts: ts[0]), (lambda t: [t])


def _qkv(groups: int, heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """q [heads*D, ...], k, v [groups*D, ...] <-> Megatron's grouped layout [groups*(heads/groups+2)*D, ...]."""
    per = heads // groups

    def join(ts: list[Tensor]) -> Tensor:
        q, k, v = ts
        rest = q.shape[1:]
        parts = [q.reshape(groups, per * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                 v.reshape(groups, head_dim, *rest)]
        return cat(parts, dim=1).reshape(-1, *rest)

    def cut(t: Tensor) -> list[Tensor]:
        rest = t.shape[1:]
        q, k, v = t.reshape(groups, (per + 2) * head_dim, *rest).split([per * head_dim, head_dim, head_dim], dim=1)
        return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]

    return join, cut


def _rows() -> tuple[Callable, Callable]:
    """(gate [F, H], up [F, H]) <-> Megatron's fc1 [2F, H]."""
    return (lambda ts: cat(ts, 0)), (lambda t: [c.contiguous() for c in t.chunk(2, 0)])


def _columns() -> tuple[Callable, Callable]:
    """(gate [F, H], up [F, H]) <-> the plugin's weight1 [H, 2F]."""
    return (lambda ts: cat(ts, 0).t().contiguous()), (lambda t: [c.contiguous() for c in t.t().chunk(2, 0)])


def _transposed() -> tuple[Callable, Callable]:
    return (lambda ts: ts[0].t().contiguous()), (lambda t: [t.t().contiguous()])


def _interleaved(rows: int, head: int, rotated: int) -> tuple[Callable, Callable]:
    """A weight [rows, ...] made of blocks of ``head`` rows whose last ``rotated`` are rotary dimensions in
    halves (pairs (i, i + r/2)) <-> the same with those rows interleaved (pairs (2i, 2i + 1)): a row
    permutation."""
    inner = torch.arange(head)
    half = torch.arange(rotated // 2)
    inner[head - rotated:] = head - rotated + torch.stack([half, half + rotated // 2], dim=1).reshape(-1)
    order = (torch.arange(rows // head)[:, None] * head + inner).reshape(-1)
    back = torch.argsort(order)
    return (lambda ts: ts[0][order].contiguous()), (lambda t: [t[back].contiguous()])


def _deinterleaved() -> tuple[Callable, Callable]:
    """GPT-OSS's [..., 2F] with gate and up interleaved (gate at even positions) <-> the plugin's [..., 2F]:
    the gate half, then the up half."""
    def join(ts: list[Tensor]) -> Tensor:
        return cat([ts[0][..., 0::2], ts[0][..., 1::2]], dim=-1).contiguous()

    def cut(t: Tensor) -> list[Tensor]:
        gate, up = t.chunk(2, dim=-1)
        return [stack([gate, up], dim=-1).flatten(-2).contiguous()]

    return join, cut


def _gate_vector() -> tuple[Callable, Callable]:
    """shared_expert_gate.weight [1, H] <-> gate_weight [H]."""
    return (lambda ts: ts[0].reshape(-1).clone()), (lambda t: [t.reshape(1, -1).clone()])


class HFMapping:
    """The rules of one model (``arch``), and the plugin-only entries it adds."""

    def __init__(self, arch: HFArchitecture):
        self.arch = arch
        self.rules: list[Rule] = []
        a = arch
        self._add("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], _copy())
        for i in range(a.num_layers):
            self._layer(i)
        self._add("decoder.final_layernorm.weight", ["model.norm.weight"], _copy())
        if not a.tied:
            self._add("output_layer.weight", ["lm_head.weight"], _copy())

    def _add(self, plugin: str, hf: list[str], fns: tuple[Callable, Callable], expert: Optional[int] = None,
             hf_row: Optional[int] = None) -> None:
        self.rules.append(Rule(plugin, tuple(hf), *fns, expert=expert, hf_row=hf_row))

    def _layer(self, i: int) -> None:
        a, p, h = self.arch, f"decoder.layers.{i}.", f"model.layers.{i}."
        self._add(p + "input_layernorm.weight", [h + "input_layernorm.weight"], _copy())
        if a.mla:
            self._mla(p + "self_attention.", h + "self_attn.")
        else:
            self._attention(p, h)
        self._add(p + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], _copy())
        if i not in a.moe_layers:
            gate, up, down = (h + f"mlp.{n}.weight" for n in DENSE_MLP)
            self._add(p + "mlp.linear_fc1.weight", [gate, up], _rows())
            self._add(p + "mlp.linear_fc2.weight", [down], _copy())
            return
        self._moe(p, h)

    def _mla(self, p: str, h: str) -> None:
        """Multi-latent attention (module docstring): the query's and the shared key's rotated rows
        interleaved when the model rotates halves."""
        a, m = self.arch, self.arch.mla
        head, rotated = m["qk_head_dim"] + m["qk_pos_emb_head_dim"], m["qk_pos_emb_head_dim"]
        heads = a.num_attention_heads

        def rotary(rows: int, block: int) -> tuple[Callable, Callable]:
            return _copy() if a.rope_interleave else _interleaved(rows, block, rotated)

        if m["q_lora_rank"] is None:
            self._add(p + "linear_q_proj.weight", [h + "q_proj.weight"], rotary(heads * head, head))
        else:
            self._add(p + "linear_q_down_proj.weight", [h + "q_a_proj.weight"], _copy())
            self._add(p + "q_layernorm.weight", [h + "q_a_layernorm.weight"], _copy())
            self._add(p + "linear_q_up_proj.weight", [h + "q_b_proj.weight"], rotary(heads * head, head))
        down = m["kv_lora_rank"] + rotated
        self._add(p + "linear_kv_down_proj.weight", [h + "kv_a_proj_with_mqa.weight"], rotary(down, down))
        self._add(p + "kv_layernorm.weight", [h + "kv_a_layernorm.weight"], _copy())
        self._add(p + "linear_kv_up_proj.weight", [h + "kv_b_proj.weight"], _copy())
        self._add(p + "linear_proj.weight", [h + "o_proj.weight"], _copy())

    def _attention(self, p: str, h: str) -> None:
        a = self.arch
        qkv = _qkv(a.num_query_groups, a.num_attention_heads, a.kv_channels)
        self._add(p + "self_attention.linear_qkv.weight", [h + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv)
        if a.qkv_bias:
            self._add(p + "self_attention.linear_qkv.bias", [h + f"self_attn.{x}_proj.bias" for x in "qkv"], qkv)
        self._add(p + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"], _copy())
        if a.linear_bias:
            self._add(p + "self_attention.linear_proj.bias", [h + "self_attn.o_proj.bias"], _copy())
        if a.attention_sinks:
            self._add(p + "self_attention.core_attention.softmax_offset", [h + "self_attn.sinks"], _copy())
        if a.qk_layernorm:
            self._add(p + "self_attention.q_layernorm.weight", [h + "self_attn.q_norm.weight"], _copy())
            self._add(p + "self_attention.k_layernorm.weight", [h + "self_attn.k_norm.weight"], _copy())

    def _moe(self, p: str, h: str) -> None:
        a = self.arch
        fam = FAMILIES[a.model_type]
        m = h + fam.moe_block + "."
        self._add(p + "mlp.router.weight", [m + f"{fam.router}.weight"], _copy())
        if fam.router_bias is not None:
            self._add(p + "mlp.router.expert_bias", [m + f"{fam.router}.{fam.router_bias}"], _copy())
        if a.router_logit_bias:
            self._add(p + "mlp.router.bias", [m + f"{fam.router}.bias"], _copy())
        E = a.num_experts
        g, u, d = fam.expert
        if fam.fused:
            for e in range(E):
                self._add(p + "mlp.experts.weight1", [m + f"experts.{g}"], _deinterleaved(), e, e)
                self._add(p + "mlp.experts.weight2", [m + f"experts.{d}"], _copy(), e, e)
                if a.expert_linear_bias:
                    self._add(p + "mlp.experts.bias1", [m + f"experts.{g}_bias"], _deinterleaved(), e, e)
                    self._add(p + "mlp.experts.bias2", [m + f"experts.{d}_bias"], _copy(), e, e)
            return
        for e in range(E):
            self._add(p + "mlp.experts.weight1", [m + f"experts.{e}.{n}.weight" for n in (g, u)], _columns(), e)
            self._add(p + "mlp.experts.weight2", [m + f"experts.{e}.{d}.weight"], _transposed(), e)
        if fam.shared is not None and a.shared_ffn_hidden_size:
            sg, su, sd = (m + f"{fam.shared_module}.{n}.weight" for n in fam.shared)
            self._add(p + "mlp.shared_expert.weight1", [sg, su], _columns())
            self._add(p + "mlp.shared_expert.weight2", [sd], _transposed())
            if fam.shared_gate is not None:
                self._add(p + "mlp.shared_expert.gate_weight", [m + f"{fam.shared_gate}.weight"], _gate_vector())

    def plugin_only(self) -> dict:
        """The plugin's entries with no HF tensor: router biases (zeros), static placements, ``_extra_state``."""
        a, out = self.arch, {}
        modules = EXTRA_STATE_MODULES
        if a.mla:
            queries = ("linear_q_proj",) if a.mla["q_lora_rank"] is None else ("linear_q_down_proj", "linear_q_up_proj")
            modules = tuple(f"self_attention.{n}" for n in queries + MLA_LINEARS) + EXTRA_STATE_MODULES[2:]
        for i in range(a.num_layers):
            p = f"decoder.layers.{i}."
            for module in modules:
                if module.startswith("mlp.linear") and i in a.moe_layers:
                    continue
                out[p + module + "._extra_state"] = None
            if i in a.moe_layers:
                if FAMILIES[a.model_type].router_bias is None:
                    out[p + "mlp.router.expert_bias"] = torch.zeros(a.num_experts)
                out[p + "mlp.experts.placement"] = torch.arange(a.num_experts)
        out["output_layer._extra_state"] = None
        return out

    def hf_keys(self) -> set[str]:
        return {k for r in self.rules for k in r.hf}
