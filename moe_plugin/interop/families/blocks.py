"""The blocks a family's tensor table is made of: attention kinds, the dense GLU, the router, the
experts (one tensor per expert, or fused), the shared expert.

Each block adds ``Rule``s to a mapping: a plugin state-dict key made from one or more HF tensors by an
exact join (concatenation, stacking, transposition, a row permutation: no arithmetic) and cut back by
its inverse, so HF -> plugin -> HF is bit-identical. Joins and cuts work on shapes alone (meta
tensors), so a conversion plans its files from the headers before it reads a tensor. The layouts on
both sides: docs/huggingface.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:   # torch is imported where a join runs: the registry (the CLI's help) needs none
    from torch import Tensor

Fns = tuple[Callable[[list["Tensor"]], "Tensor"], Callable[["Tensor"], list["Tensor"]]]
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Rule:
    """``plugin`` (its row ``expert`` of an expert weight [E, ...]) = ``join``(the ``hf`` tensors);
    ``cut`` gives them back."""

    plugin: str
    hf: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    cut: Callable[[Tensor], list[Tensor]]
    expert: Optional[int] = None
    hf_row: Optional[int] = None   # the HF tensors are fused [E, ...]: the rule joins their row ``hf_row``


def copy() -> Fns:
    return (lambda ts: ts[0]), (lambda t: [t])


def qkv(groups: int, heads: int, head_dim: int) -> Fns:
    """q [heads*D, ...], k, v [groups*D, ...] <-> Megatron's grouped layout [groups*(heads/groups+2)*D, ...]."""
    from moe_plugin.checkpoint.shards import cat

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


def rows() -> Fns:
    """(gate [F, H], up [F, H]) <-> Megatron's fc1 [2F, H]."""
    from moe_plugin.checkpoint.shards import cat

    return (lambda ts: cat(ts, 0)), (lambda t: [c.contiguous() for c in t.chunk(2, 0)])


def columns() -> Fns:
    """(gate [F, H], up [F, H]) <-> the plugin's weight1 [H, 2F]."""
    from moe_plugin.checkpoint.shards import cat

    return (lambda ts: cat(ts, 0).t().contiguous()), (lambda t: [c.contiguous() for c in t.t().chunk(2, 0)])


def transposed() -> Fns:
    return (lambda ts: ts[0].t().contiguous()), (lambda t: [t.t().contiguous()])


def pair_rows(head: int, rotated: int, to_pairs: bool) -> Callable[["Tensor"], "Tensor"]:
    """Each block of ``head`` rows of a weight [blocks * head, ...], whose last ``rotated`` are rotary
    dimensions, moved from halves (pairs (i, i + r/2)) to interleaved pairs (2i, 2i + 1) (``to_pairs``),
    or back: a row permutation."""
    import torch

    inner = torch.arange(head)
    half = torch.arange(rotated // 2)
    inner[head - rotated:] = head - rotated + torch.stack([half, half + rotated // 2], dim=1).reshape(-1)
    if not to_pairs:
        inner = torch.argsort(inner)

    def move(t: "Tensor") -> "Tensor":
        order = (torch.arange(t.shape[0] // head)[:, None] * head + inner).reshape(-1)
        return t[order].contiguous()

    return move


def interleaved(head: int, rotated: int) -> Fns:
    """Rotary rows in halves (HF) <-> interleaved in pairs (the plugin's MLA): ``pair_rows`` both ways."""
    to_pairs, to_halves = pair_rows(head, rotated, True), pair_rows(head, rotated, False)
    return (lambda ts: to_pairs(ts[0])), (lambda t: [to_halves(t)])


def deinterleaved() -> Fns:
    """[..., 2F] with gate and up interleaved (gate at even positions) <-> the gate half, then the up half."""
    from moe_plugin.checkpoint.shards import cat, stack

    def join(ts: list[Tensor]) -> Tensor:
        return cat([ts[0][..., 0::2], ts[0][..., 1::2]], dim=-1).contiguous()

    def cut(t: Tensor) -> list[Tensor]:
        gate, up = t.chunk(2, dim=-1)
        return [stack([gate, up], dim=-1).flatten(-2).contiguous()]

    return join, cut


def vector() -> Fns:
    """[1, N] <-> [N] (a shared expert's gate, a correction bias kept as a row)."""
    return (lambda ts: ts[0].reshape(-1).clone()), (lambda t: [t.reshape(1, -1).clone()])


class Attention:
    """Grouped-query attention: q/k/v/o projections under ``self_attn.``, optional biases, sinks, QK-norm.
    ``rope_pairs`` "interleaved": the model rotates the pairs (2i, 2i + 1) of each head (ERNIE-4.5), so the
    import puts each head's query and key rows in halves, the pairs (i, i + D/2) Megatron rotates."""

    extra_state = ("self_attention.linear_qkv", "self_attention.linear_proj")

    def __init__(self, rope_pairs: str = "halves"):
        self.rope_pairs = rope_pairs

    def rules(self, m: Any, a: Any, p: str, h: str) -> None:
        fns = qkv(a.num_query_groups, a.num_attention_heads, a.kv_channels)
        if self.rope_pairs == "interleaved":
            (join, cut), D = fns, a.kv_channels
            halves, pairs = pair_rows(D, D, to_pairs=False), pair_rows(D, D, to_pairs=True)
            fns = ((lambda ts: join([halves(ts[0]), halves(ts[1]), ts[2]])),
                   (lambda t: (lambda q, k, v: [pairs(q), pairs(k), v])(*cut(t))))
        m.add(p + "self_attention.linear_qkv.weight", [h + f"self_attn.{x}_proj.weight" for x in "qkv"], fns)
        if a.qkv_bias:
            m.add(p + "self_attention.linear_qkv.bias", [h + f"self_attn.{x}_proj.bias" for x in "qkv"], fns)
        m.add(p + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"], copy())
        if a.linear_bias:
            m.add(p + "self_attention.linear_proj.bias", [h + "self_attn.o_proj.bias"], copy())
        if a.attention_sinks:
            m.add(p + "self_attention.core_attention.softmax_offset", [h + "self_attn.sinks"], copy())
        if a.qk_layernorm:
            m.add(p + "self_attention.q_layernorm.weight", [h + "self_attn.q_norm.weight"], copy())
            m.add(p + "self_attention.k_layernorm.weight", [h + "self_attn.k_norm.weight"], copy())

    def modules(self, a: Any) -> tuple[str, ...]:
        """The Megatron linears whose state dict carries a (None) ``_extra_state``."""
        return self.extra_state


class LatentAttention(Attention):
    """DeepSeek's multi-latent attention as Megatron's ``MLASelfAttention``; the query's and the shared
    key's rotated rows interleaved at import when the model rotates halves (``rope_interleave`` false)."""

    def rules(self, m: Any, a: Any, p: str, h: str) -> None:
        p, h, s = p + "self_attention.", h + "self_attn.", a.mla
        head, rotated = s["qk_head_dim"] + s["qk_pos_emb_head_dim"], s["qk_pos_emb_head_dim"]

        def rotary(block: int) -> Fns:
            return copy() if a.rope_interleave else interleaved(block, rotated)

        if s["q_lora_rank"] is None:
            m.add(p + "linear_q_proj.weight", [h + "q_proj.weight"], rotary(head))
        else:
            m.add(p + "linear_q_down_proj.weight", [h + "q_a_proj.weight"], copy())
            m.add(p + "q_layernorm.weight", [h + "q_a_layernorm.weight"], copy())
            m.add(p + "linear_q_up_proj.weight", [h + "q_b_proj.weight"], rotary(head))
        down = s["kv_lora_rank"] + rotated
        m.add(p + "linear_kv_down_proj.weight", [h + "kv_a_proj_with_mqa.weight"], rotary(down))
        m.add(p + "kv_layernorm.weight", [h + "kv_a_layernorm.weight"], copy())
        m.add(p + "linear_kv_up_proj.weight", [h + "kv_b_proj.weight"], copy())
        m.add(p + "linear_proj.weight", [h + "o_proj.weight"], copy())

    def modules(self, a: Any) -> tuple[str, ...]:
        queries = ("linear_q_proj",) if a.mla["q_lora_rank"] is None else ("linear_q_down_proj", "linear_q_up_proj")
        return tuple(f"self_attention.{n}" for n in queries + ("linear_kv_down_proj", "linear_kv_up_proj",
                                                               "linear_proj"))


@dataclass(frozen=True)
class DenseMLP:
    """A dense SwiGLU MLP: gate and up rows in Megatron's fc1 [2F, H], down as fc2."""

    module: str = "mlp"
    names: tuple[str, str, str] = DENSE_MLP

    def rules(self, m: Any, a: Any, p: str, h: str) -> None:
        gate, up, down = (h + f"{self.module}.{n}.weight" for n in self.names)
        m.add(p + "mlp.linear_fc1.weight", [gate, up], rows())
        m.add(p + "mlp.linear_fc2.weight", [down], copy())


@dataclass(frozen=True)
class Router:
    """The router's weight [E, H] at ``name``; the correction bias (the plugin's ``expert_bias``) at
    ``correction_bias`` under the MoE block, stored as [E] or, with ``bias_as_row``, [1, E]."""

    name: str = "gate"
    correction_bias: Optional[str] = None
    bias_as_row: bool = False

    def rules(self, m: Any, a: Any, p: str, block: str) -> None:
        m.add(p + "mlp.router.weight", [block + f"{self.name}.weight"], copy())
        if self.correction_bias is not None:
            m.add(p + "mlp.router.expert_bias", [block + self.correction_bias],
                  vector() if self.bias_as_row else copy())
        if a.router_logit_bias:
            m.add(p + "mlp.router.bias", [block + f"{self.name}.bias"], copy())


@dataclass(frozen=True)
class Experts:
    """One tensor per expert and projection: ``experts.{e}.<gate|up|down>.weight``."""

    names: tuple[str, str, str] = DENSE_MLP

    def rules(self, m: Any, a: Any, p: str, block: str) -> None:
        g, u, d = self.names
        for e in range(a.num_experts):
            m.add(p + "mlp.experts.weight1", [block + f"experts.{e}.{n}.weight" for n in (g, u)], columns(), e)
            m.add(p + "mlp.experts.weight2", [block + f"experts.{e}.{d}.weight"], transposed(), e)


@dataclass(frozen=True)
class FusedExperts:
    """A layer's experts as 3-D tensors: ``gate_up`` [E, H, 2F] (gate and up interleaved) and ``down``
    [E, F, H], with their biases ``<name>_bias`` when the model has expert biases."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"

    def rules(self, m: Any, a: Any, p: str, block: str) -> None:
        g, d = block + f"experts.{self.gate_up}", block + f"experts.{self.down}"
        for e in range(a.num_experts):
            m.add(p + "mlp.experts.weight1", [g], deinterleaved(), e, e)
            m.add(p + "mlp.experts.weight2", [d], copy(), e, e)
            if a.expert_linear_bias:
                m.add(p + "mlp.experts.bias1", [g + "_bias"], deinterleaved(), e, e)
                m.add(p + "mlp.experts.bias2", [d + "_bias"], copy(), e, e)


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert(s) under ``module`` as one SwiGLU of their summed size; ``gate``: the module of
    a sigmoid gate [1, H] (the plugin's ``gate_weight`` [H])."""

    module: str = "shared_expert"
    names: tuple[str, str, str] = DENSE_MLP
    gate: Optional[str] = None

    def rules(self, m: Any, a: Any, p: str, block: str) -> None:
        sg, su, sd = (block + f"{self.module}.{n}.weight" for n in self.names)
        m.add(p + "mlp.shared_expert.weight1", [sg, su], columns())
        m.add(p + "mlp.shared_expert.weight2", [sd], transposed())
        if self.gate is not None:
            m.add(p + "mlp.shared_expert.gate_weight", [block + f"{self.gate}.weight"], vector())


@dataclass(frozen=True)
class MoEBlock:
    """An MoE layer's MLP module ``module``: its router, its experts, its shared expert if any."""

    module: str = "mlp"
    router: Router = Router()
    experts: Any = Experts()
    shared: Optional[SharedExpert] = None

    def rules(self, m: Any, a: Any, p: str, h: str) -> None:
        block = h + self.module + "."
        self.router.rules(m, a, p, block)
        self.experts.rules(m, a, p, block)
        if self.shared is not None and a.shared_ffn_hidden_size:
            self.shared.rules(m, a, p, block)
