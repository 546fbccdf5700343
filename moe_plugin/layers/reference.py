"""A naive reference MoE: plain Python loops over tokens and their choices, the test oracle. Written
to be obviously right, not fast; it shares no code with the layer but the capacity formula, and takes
the layer's weights by state-dict name and the same random numbers. docs/design/layers_router.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_plugin.configs.capacity import expert_capacity
from moe_plugin.configs.schema import MoEConfig


@dataclass
class ReferenceResult:
    out: Tensor                  # [T, H], input dtype
    balance_loss: Tensor         # mean over groups, before aux_loss_coeff
    z_loss: Tensor               # mean over groups, before z_loss_coeff
    group_balance_losses: list[Tensor]
    group_z_losses: list[Tensor]
    kept_per_expert: list[int]   # summed over groups
    routed_per_expert: list[int]
    capacities: list[Optional[int]]

    def weighted_aux_loss(self, config: MoEConfig) -> Tensor:
        return config.aux_loss_coeff * self.balance_loss + config.z_loss_coeff * self.z_loss


def _act(config: MoEConfig, h: Tensor) -> Tensor:
    name = config.activation
    if name == "gelu":
        return F.gelu(h)
    if name == "relu":
        return torch.relu(h)
    half = h.shape[-1] // 2               # swiglu: gate half, then up half
    gate, up = h[:half], h[half:]
    if name == "clamped_swiglu":          # GPT-OSS: written out as its model card gives it
        limit = config.swiglu_limit
        gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
        up = torch.where(up > limit, torch.full_like(up, limit), torch.where(up < -limit, -limit, up))
        return gate / (1 + torch.exp(-config.swiglu_alpha * gate)) * (up + 1)
    return F.silu(gate) * up


def _ffn(x_H: Tensor, w1: Tensor, w2: Tensor, config: MoEConfig, b1: Optional[Tensor] = None,
         b2: Optional[Tensor] = None) -> Tensor:
    h = x_H @ w1.to(x_H.dtype)
    if b1 is not None:
        h = h + b1.to(x_H.dtype)
    y = _act(config, h) @ w2.to(x_H.dtype)
    return y if b2 is None else y + b2.to(x_H.dtype)


def reference_moe(x_TH: Tensor, params: Mapping[str, Tensor], config: MoEConfig, *, training: bool,
                  jitter_TH: Optional[Tensor] = None, uniform_T: Optional[Tensor] = None,
                  group_sizes: Optional[Sequence[int]] = None,
                  document_T: Optional[Sequence[int]] = None) -> ReferenceResult:
    """The MoE layer's output for ``x_TH`` [T, H] from its parameters by state-dict name and its random
    numbers (used when ``training``); ``document_T`` [T]: document ids, -1 padding."""
    T = x_TH.shape[0]
    sizes = list(group_sizes) if group_sizes is not None else [T]
    if sum(sizes) != T:
        raise ValueError(f"group sizes {sizes} do not add up to {T} tokens")
    docs = None if document_T is None else [int(d) for d in document_T]
    rows, balances, zs, caps = [], [], [], []
    kept = [0] * config.num_experts
    routed = [0] * config.num_experts
    start = 0
    for size in sizes:
        if docs is None:
            real, x_group = None, x_TH[start:start + size]
            jit = jitter_TH[start:start + size] if (training and jitter_TH is not None) else None
            uni = uniform_T[start:start + size] if (training and uniform_T is not None) else None
        else:               # the group's real tokens, by themselves
            real = [t for t in range(start, start + size) if docs[t] >= 0]
            x_group = x_TH[real] if real else x_TH.new_zeros(0, x_TH.shape[1])
            jit = jitter_TH[real] if (training and jitter_TH is not None) else None
            uni = uniform_T[real] if (training and uniform_T is not None) else None
        per_document = [docs[t] for t in real] if real is not None and config.aux_loss_scope == "sequence" else None
        out, balance, z, cap = _one_group(x_group, params, config, training, jit, uni, kept, routed, per_document)
        if real is not None:  # padding rows: zero
            by_token = dict(zip(real, out))
            out = [by_token.get(t, x_TH.new_zeros(x_TH.shape[1])) for t in range(start, start + size)]
        rows.extend(out)
        balances.append(balance)
        zs.append(z)
        caps.append(cap)
        start += size
    out_TH = torch.stack(rows) if rows else x_TH.new_zeros(0, x_TH.shape[1])
    return ReferenceResult(out=out_TH, balance_loss=torch.stack(balances).mean(), z_loss=torch.stack(zs).mean(),
                           group_balance_losses=balances, group_z_losses=zs, kept_per_expert=kept,
                           routed_per_expert=routed, capacities=caps)


def _allowed_experts(score: list[float], config: MoEConfig) -> list[int]:
    """The experts a token with selection scores ``score`` may choose: all, or those of its best
    group_topk groups (consecutive ids), equal group scores to the lower group."""
    E, M = config.num_experts, config.group_topk
    if M is None:
        return list(range(E))
    G = config.router_groups
    size = E // G
    if config.score_function == "softmax" and config.expert_bias_on != "scores":
        top = max(score)
        weights = [math.exp(s - top) for s in score]
        score = [w / sum(weights) for w in weights]
    n = 1 if config.group_score == "max" else 2
    group_score = [sum(sorted(score[g * size:(g + 1) * size], reverse=True)[:n]) for g in range(G)]
    best = sorted(range(G), key=lambda g: (-group_score[g], g))[:M]
    return [e for e in range(E) if e // size in best]


def _one_group(x_TH, params, config, training, jitter_TH, uniform_T, kept, routed, documents=None):
    T, E, k = x_TH.shape[0], config.num_experts, config.k
    W = params["router.weight"].float()
    bias = params.get("router.expert_bias")
    bias = [0.0] * E if bias is None else [float(b) for b in bias]
    normalize = config.router == "gshard" or (config.router == "topk" and config.normalize_gates)
    sigmoid = config.score_function == "sigmoid"
    random_second = training and config.router == "gshard" and config.second_expert_policy == "random"

    # 1. Each token's choices and gates.
    logits, probs, chosen, gates, wanted = [], [], [], [], []
    for t in range(T):
        x = x_TH[t].float()
        if jitter_TH is not None:
            x = x * jitter_TH[t]
        logit = W @ x
        if params.get("router.bias") is not None:
            logit = logit + params["router.bias"].float()
        if not torch.isfinite(logit).all():
            raise ValueError("reference MoE: the layer input contains NaN or inf")
        prob = torch.sigmoid(logit) if sigmoid else torch.softmax(logit, dim=0)
        choice = prob if sigmoid or config.expert_bias_on == "scores" else logit
        score = [float(choice[e].detach()) + bias[e] for e in range(E)]
        experts = sorted(_allowed_experts(score, config), key=lambda e: (-score[e], e))[:k]
        g = [prob[e] for e in experts]
        if normalize:
            total = sum(g)
            g = [gi / total for gi in g]
        keep = [True] * k
        if random_second:
            keep[1] = 2 * float(g[1].detach()) > float(uniform_T[t])
        if config.gate_scale != 1.0:
            g = [gi * config.gate_scale for gi in g]
        logits.append(logit)
        probs.append(prob)
        chosen.append(experts)
        gates.append(g)
        wanted.append(keep)

    # 2. Capacity. Each expert's routes in GShard's priority (choice by choice, token by token),
    # or by drop_policy probability; an expert keeps the first `capacity` of them.
    capacity = None
    if config.drop_tokens:
        factor = config.capacity_factor if training else config.eval_capacity_factor
        capacity = expert_capacity(T, E, k, factor, config.min_capacity)   # the layer's exact formula
    queue = [[] for _ in range(E)]             # per expert: (token, choice) in GShard's order
    for j in range(k):
        for t in range(T):
            if wanted[t][j]:
                queue[chosen[t][j]].append((t, j))
    if capacity is not None and config.drop_policy == "probability":   # highest score first, then the order above
        for e in range(E):
            queue[e] = sorted(queue[e], key=lambda tj: -float(probs[tj[0]][e].detach()))
    kept_routes = []                           # (token, choice)
    for e in range(E):
        keep = queue[e] if capacity is None else queue[e][:capacity]
        routed[e] += len(queue[e])
        kept[e] += len(keep)
        kept_routes.extend(keep)

    # 3. Outputs: each kept route's gate times its expert applied to the token.
    w1, w2 = params["experts.weight1"], params["experts.weight2"]
    b1, b2 = params.get("experts.bias1"), params.get("experts.bias2")
    acc = [x_TH.new_zeros(x_TH.shape[1], dtype=torch.float32) for _ in range(T)]
    for t, j in kept_routes:
        e = chosen[t][j]
        y = _ffn(x_TH[t], w1[e], w2[e], config, None if b1 is None else b1[e], None if b2 is None else b2[e])
        acc[t] = acc[t] + gates[t][j] * y.float()
    out = [a.to(x_TH.dtype) for a in acc]
    if "shared_expert.weight1" in params:
        for t in range(T):
            y = _ffn(x_TH[t], params["shared_expert.weight1"], params["shared_expert.weight2"], config)
            if params.get("shared_expert.gate_weight") is not None:
                y = y * torch.sigmoid(x_TH[t] @ params["shared_expert.gate_weight"].to(x_TH.dtype))
            out[t] = out[t] + y

    # 4. Losses. Softmax: GShard's (first choices x mean probability); sigmoid: DeepSeek-V3's
    # (all k choices x mean score share of the token's scores). Per document: each one's tokens.
    def balance_of(tokens: list[int]) -> Tensor:
        n = max(len(tokens), 1)
        if sigmoid:
            fraction = [sum(chosen[t].count(e) for t in tokens) / (n * k) for e in range(E)]
            share = {t: [probs[t][e] / probs[t].sum() for e in range(E)] for t in tokens}
        else:
            fraction = [sum(1 for t in tokens if chosen[t][0] == e) / n for e in range(E)]
            share = {t: [probs[t][e] for e in range(E)] for t in tokens}
        mean_share = [sum((share[t][e] for t in tokens), torch.zeros(())) / n for e in range(E)]
        return E * sum((fraction[e] * mean_share[e] for e in range(E)), torch.zeros(()))

    if documents is None:
        balance = balance_of(list(range(T)))
    else:
        names = list(dict.fromkeys(documents))          # the documents present, in order
        losses = [balance_of([t for t in range(T) if documents[t] == d]) for d in names]
        balance = torch.stack(losses).mean() if losses else torch.zeros(())
    z = sum((torch.logsumexp(logits[t], dim=0) ** 2 for t in range(T)), torch.zeros(())) / max(T, 1)
    return out, balance, z, capacity
