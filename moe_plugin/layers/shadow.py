"""Shadow experts (FasterMoE's hot-expert replication): a few experts computed where the tokens are.

Shape suffixes: T tokens, H hidden, F1 the first GEMM's width, F ffn, L local experts, S expert
slots, R kept routes, N shadowed experts (in slot order).

A shadowed expert keeps its one owner, the EP rank whose slot holds it (``experts.placement``),
and its one set of parameters and optimizer state there. Per forward of a layer with shadowed
experts (``MoELayer.set_shadow``; every EP rank has the same set):

1. The routes to shadowed experts stay out of the exchange: the dispatcher sends and receives
   the other routes only (``ExpertParallelDispatcher.prepare(plan, shadow_S)``; the count
   all-gather still carries every kept route, so the load record is unchanged).
2. ``ShadowWeights``: every EP rank gets the shadowed experts' weights from their owners, in
   one all-reduce over EP of an [N, H*F1 + F*H] buffer in which each owner fills its rows
   (adding exact zeros: the copies are bit-identical to the owner's weights).
3. Every EP rank runs its own tokens' routes to shadowed experts through those copies
   (``ffn_autograd.expert_ffn``, with the layer's expert gradient factor).
4. Combine takes both row sets: each token's routes are found by route id and summed in the
   same order, so the output is the one without shadowing (up to the rounding of the expert
   GEMMs, which see other blocks of rows).
5. Backward of 2: the copies' gradients (each rank's partial sum over its own tokens) are
   all-reduced over EP and the owner adds its rows to its experts' gradients. The owner's
   ``.grad`` is then the same sum over every EP rank's routes that the exchange path gives (up to
   the order of the additions), so its optimizer step is unchanged.

Capacity and dropping are decided by the router before any of this, per expert; shadowing moves
where a kept route is computed, never whether it is kept. Only without expert tensor
parallelism (an ETP shard's partial output would need the ETP peers' tokens).

Not done: overlapping the weights' all-reduce with the all-to-all (FasterMoE overlaps them; here
it runs after the exchange), and one reduce per owner in backward instead of the all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moe_plugin.layers.router import RoutingPlan


@dataclass(frozen=True)
class ShadowRoutes:
    """This rank's kept routes to shadowed experts, grouped by expert in slot order."""

    slots: list[int]       # [N] the shadowed experts' slots, ascending
    counts: list[int]      # [N] routes per shadowed expert
    token_R: Tensor        # token of each route
    gate_R: Tensor         # its gate (differentiable)
    route_R: Tensor        # its route id


def shadow_slots(placement_E: Tensor, shadow_E: Tensor) -> Tensor:
    """[S] bool: the slots that hold a shadowed expert (``shadow_E`` is by expert id)."""
    slot_mask_S = torch.zeros_like(shadow_E)
    slot_mask_S[placement_E] = shadow_E
    return slot_mask_S


def split_routes(plan: RoutingPlan, shadow_S: Tensor) -> tuple[RoutingPlan, ShadowRoutes]:
    """``plan`` (kept routes sorted by slot) -> the plan of the exchanged routes (``kept_S`` zero
    at shadowed slots) and the routes to shadowed experts. One host sync."""
    S = plan.kept_S.numel()
    R = plan.route_R.numel()
    slot_R = torch.repeat_interleave(torch.arange(S, device=plan.kept_S.device), plan.kept_S, output_size=R)
    local_R = shadow_S[slot_R]
    exchanged_R = (~local_R).nonzero().squeeze(1)
    shadowed_R = local_R.nonzero().squeeze(1)
    slots_N = shadow_S.nonzero().squeeze(1)
    host = torch.cat([slots_N, plan.kept_S[slots_N].long()]).tolist()
    N = slots_N.numel()
    routes = ShadowRoutes(slots=host[:N], counts=host[N:], token_R=plan.token_R[shadowed_R],
                          gate_R=plan.gate_R[shadowed_R], route_R=plan.route_R[shadowed_R])
    exchanged = RoutingPlan(num_tokens=plan.num_tokens, k=plan.k, route_R=plan.route_R[exchanged_R],
                            token_R=plan.token_R[exchanged_R], gate_R=plan.gate_R[exchanged_R], kept_E=plan.kept_E,
                            routed_E=plan.routed_E, capacity=plan.capacity, balance_loss=plan.balance_loss,
                            z_loss=plan.z_loss, kept_S=plan.kept_S.masked_fill(shadow_S, 0), exchange=plan.exchange)
    return exchanged, routes


class ShadowWeights(torch.autograd.Function):
    """Forward: the N shadowed experts' weights on every rank of ``group`` (module docstring, 2).
    Backward: their gradients summed over ``group``; the owner gets its rows (5).

    ``owned``: (position in the N, local index) of the shadowed experts this rank owns."""

    @staticmethod
    def forward(ctx, w1_LHF1: Tensor, w2_LFH: Tensor, owned: list[tuple[int, int]], N: int,
                group: Optional[dist.ProcessGroup]):
        _, H, F1 = w1_LHF1.shape
        F = w2_LFH.shape[1]
        buf_NX = w1_LHF1.new_zeros(N, H * F1 + F * H)
        if owned:
            pos, local = (torch.tensor(v, dtype=torch.long, device=w1_LHF1.device) for v in zip(*owned))
            buf_NX[pos] = torch.cat([w1_LHF1[local].reshape(len(owned), -1),
                                     w2_LFH[local].reshape(len(owned), -1)], dim=1)
        if group is not None:
            dist.all_reduce(buf_NX, group=group)
        ctx.owned, ctx.group, ctx.shapes = owned, group, (w1_LHF1.shape, w2_LFH.shape)
        return (buf_NX[:, :H * F1].reshape(N, H, F1).contiguous(),
                buf_NX[:, H * F1:].reshape(N, F, H).contiguous())

    @staticmethod
    def backward(ctx, grad_w1_NHF1: Optional[Tensor], grad_w2_NFH: Optional[Tensor]):
        (L, H, F1), (_, F, _) = ctx.shapes
        N = len(grad_w1_NHF1) if grad_w1_NHF1 is not None else len(grad_w2_NFH)
        parts = [g.reshape(N, -1) if g is not None else None for g in (grad_w1_NHF1, grad_w2_NFH)]
        ref = next(p for p in parts if p is not None)
        parts = [p if p is not None else ref.new_zeros(N, size) for p, size in zip(parts, (H * F1, F * H))]
        buf_NX = torch.cat(parts, dim=1)
        if ctx.group is not None:
            dist.all_reduce(buf_NX, group=ctx.group)
        if not ctx.owned:
            return None, None, None, None, None
        pos, local = (torch.tensor(v, dtype=torch.long, device=buf_NX.device) for v in zip(*ctx.owned))
        grad_w1 = buf_NX.new_zeros(L, H, F1)
        grad_w2 = buf_NX.new_zeros(L, F, H)
        grad_w1[local] = buf_NX[pos, :H * F1].reshape(-1, H, F1)
        grad_w2[local] = buf_NX[pos, H * F1:].reshape(-1, F, H)
        return grad_w1, grad_w2, None, None, None


def shadow_weights(w1_LHF1: Tensor, w2_LFH: Tensor, slots: list[int], first_slot: int,
                   group: Optional[dist.ProcessGroup]) -> tuple[Tensor, Tensor]:
    """[N, H, F1] and [N, F, H]: the weights of the experts in ``slots`` (ascending), from their
    owners; this rank owns slots ``[first_slot, first_slot + L)``."""
    L = w1_LHF1.shape[0]
    owned = [(j, s - first_slot) for j, s in enumerate(slots) if first_slot <= s < first_slot + L]
    return ShadowWeights.apply(w1_LHF1, w2_LFH, owned, len(slots), group)


__all__ = ["ShadowRoutes", "ShadowWeights", "shadow_slots", "shadow_weights", "split_routes"]
