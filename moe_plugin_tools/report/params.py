"""Parameters and training FLOPs of the example's GPT-MoE, from the run's flags.

The example's GPT is Megatron-Core's ``GPTModel`` with learned absolute positions, LayerNorm,
biased attention and dense-MLP linears, and an output layer that shares the word embedding's
weight (Megatron-LM's default) or, with ``--untie-embeddings-and-output-weights`` (and in runs
whose run.json predates the flag), has a weight of its own. With V the padded vocabulary, P the position embeddings, h the hidden size, f the
dense FFN size, f_e the expert FFN size (``moe.ffn_hidden_size``, default f), f_s the shared
expert's FFN size, E experts, k of them per token, m = 3 for swiglu experts (gate, up, down),
2 otherwise, the parameters are exactly:

    embeddings               V h + P h
    every layer              4 h^2 + 4 h  (QKV and output projections, biases)  +  4 h  (two LayerNorms)
    a dense MLP              2 h f + f + h
    (with ``--disable-bias-linear`` the linears have no biases: no 4 h per layer, no f + h per dense MLP)
    an MoE MLP               h E  +  E m h f_e  +  m h f_s  (+ h for a shared-expert gate)
    final LayerNorm          2 h
    output layer             V h  (untied only; tied, it is the word embedding's weight)

Active per token: an MoE MLP counts h E + k m h f_e + m h f_s (+ h) instead: the router and
the k chosen experts. Layer i (0-based) is MoE when it is in ``moe.layers``, or else when
i % layer_interval == 0; with ``--dense`` no layer is.

Training FLOPs per token (forward and backward, 3x the forward's multiply-adds x 2):

    6 (L 4 h^2 + sum of the active MLP matrices + V h)  +  12 L s h

the second term being the attention scores (QK^T and the weighted sum of V over s positions;
causal masking not subtracted, as Megatron counts it). Biases, norms and softmaxes are O(h)
per token and left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROUTER_DEFAULT_TOP_K = {"gshard": 2, "switch": 1, "topk": 2}


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the whole model (see the module docstring) and its training FLOPs per token."""

    total: int
    active: int          # per token: top-k experts of each MoE layer
    expert: int          # in the experts of the MoE layers (all E)
    moe_layers: tuple[int, ...]
    flops_per_token: int


def top_k_of(moe: dict) -> Optional[int]:
    """The ``top_k`` of a "moe" block, with the router's default when it is not set."""
    if moe.get("top_k") is not None:
        return int(moe["top_k"])
    return ROUTER_DEFAULT_TOP_K.get(moe.get("router", "gshard"))


def moe_layer_indices(num_layers: int, moe: dict, dense: bool = False) -> tuple[int, ...]:
    if dense:
        return ()
    if moe.get("layers") is not None:
        return tuple(sorted(int(i) for i in moe["layers"]))
    interval = int(moe.get("layer_interval", 1))
    return tuple(i for i in range(num_layers) if i % interval == 0)


def count_params(args: dict, moe: dict, vocab_size: Optional[int]) -> Optional[ParamCount]:
    """Count from run.json's ``args``, its "moe" block and the padded vocabulary; None when a
    needed value is missing (an older run.json has no ``vocab_size``)."""
    h, layers, seq = args.get("hidden_size"), args.get("num_layers"), args.get("seq_length")
    experts, k = moe.get("num_experts"), top_k_of(moe)
    if not (h and layers and seq and vocab_size and experts and k):
        return None
    positions = args.get("max_position_embeddings") or seq
    f = args.get("ffn_hidden_size") or 4 * h          # Megatron's default when the flag is unset
    f_e = moe.get("ffn_hidden_size") or f
    f_s = moe.get("shared_expert_ffn_hidden_size") or 0
    m = 3 if moe.get("activation") == "swiglu" else 2
    shared = m * h * f_s + (h if f_s and moe.get("shared_expert_gate") else 0)
    moe_at = moe_layer_indices(layers, moe, bool(args.get("dense")))
    attention = 4 * h * h
    untied = args.get("untie_embeddings_and_output_weights", True)   # older runs: untied
    total = vocab_size * h + positions * h + 2 * h + (vocab_size * h if untied else 0)
    expert = 0
    matrices = layers * attention + vocab_size * h     # active weight matrices, for the FLOPs
    bias = 0 if args.get("disable_bias_linear") else 1
    for i in range(layers):
        total += attention + bias * 4 * h + 4 * h
        if i in moe_at:
            total += h * experts + experts * m * h * f_e + shared
            expert += experts * m * h * f_e
            matrices += h * experts + k * m * h * f_e + m * h * f_s
        else:
            total += 2 * h * f + bias * (f + h)
            matrices += 2 * h * f
    active = total - expert + expert * k // experts    # of each layer's E experts, k are active
    return ParamCount(total=total, active=active, expert=expert, moe_layers=moe_at,
                      flops_per_token=6 * matrices + 12 * layers * seq * h)
