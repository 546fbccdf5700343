"""Parameters of the example's GPT-MoE, total and active per token, from the run's flags.

The count covers the weight matrices of the transformer layers, the ones that set the compute
per token; embeddings, biases and layer norms are left out (the vocabulary is not in the flags,
and biases and norms are O(h) per layer, under 1% at the example's sizes). With h the hidden
size, f the dense FFN size, f_e the expert FFN size (``moe.ffn_hidden_size``, default f),
f_s the shared-expert FFN size, E experts, k of them per token, and m = 3 for swiglu (gate,
up and down projections), 2 otherwise:

    attention, every layer        4 h^2                    (Q, K, V and output projections)
    dense MLP, a dense layer      2 h f
    MoE MLP, an MoE layer         h E  +  E m h f_e  +  m h f_s  (+ h for a shared-expert gate)
    active in an MoE layer        h E  +  k m h f_e  +  m h f_s  (+ h)

The router (h E) is active for every token; of the experts only the k chosen ones are.
Layer i (0-based) is MoE when it is in ``moe.layers``, or else when i % layer_interval == 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROUTER_DEFAULT_TOP_K = {"gshard": 2, "switch": 1, "topk": 2}


@dataclass(frozen=True)
class ParamCount:
    """Weight-matrix parameters of the transformer layers (see the module docstring)."""

    total: int
    active: int          # per token: top-k experts of each MoE layer
    moe_layers: tuple[int, ...]


def top_k_of(moe: dict) -> Optional[int]:
    """The ``top_k`` of a "moe" block, with the router's default when it is not set."""
    if moe.get("top_k") is not None:
        return int(moe["top_k"])
    return ROUTER_DEFAULT_TOP_K.get(moe.get("router", "gshard"))


def moe_layer_indices(num_layers: int, moe: dict) -> tuple[int, ...]:
    if moe.get("layers") is not None:
        return tuple(sorted(int(i) for i in moe["layers"]))
    interval = int(moe.get("layer_interval", 1))
    return tuple(i for i in range(num_layers) if i % interval == 0)


def count_params(args: dict, moe: dict) -> Optional[ParamCount]:
    """Count from run.json's ``args`` and its "moe" block; None when a needed flag is missing."""
    h, layers = args.get("hidden_size"), args.get("num_layers")
    experts, k = moe.get("num_experts"), top_k_of(moe)
    if not h or not layers or not experts or not k:
        return None
    f = args.get("ffn_hidden_size") or 4 * h          # Megatron's default when the flag is unset
    f_e = moe.get("ffn_hidden_size") or f
    f_s = moe.get("shared_expert_ffn_hidden_size") or 0
    m = 3 if moe.get("activation") == "swiglu" else 2
    shared = m * h * f_s + (h if f_s and moe.get("shared_expert_gate") else 0)
    moe_at = moe_layer_indices(layers, moe)
    total = active = 0
    for i in range(layers):
        attention = 4 * h * h
        if i in moe_at:
            total += attention + h * experts + experts * m * h * f_e + shared
            active += attention + h * experts + k * m * h * f_e + shared
        else:
            total += attention + 2 * h * f
            active += attention + 2 * h * f
    return ParamCount(total=total, active=active, moe_layers=moe_at)
