"""Shadow experts (FasterMoE's hot-expert replication): a few experts computed where the tokens are,
from bit-identical copies of their one owner's weights (one all-reduce); the owner's ``.grad`` gets
the copies' gradients. Shadowing moves where a kept route is computed, never whether it is kept;
only without ETP. Shape suffixes: see ``moe_plugin.layers``; the steps: docs/design/layers_exchange.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.router import RoutingPlan, stable_partition

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts


@dataclass(frozen=True)
class ShadowRoutes:
    """This rank's kept routes to shadowed experts, grouped by expert in slot order."""

    slots: HostValue       # [D] the shadowed experts' slots, ascending, on the device and the host
    counts: RowCounts      # [D] routes per shadowed expert
    token_R: Tensor        # token of each route
    gate_R: Tensor         # its gate (differentiable)
    route_R: Tensor        # its route id


@dataclass(eq=False)
class Held:
    """The shadowed slots of one forward, before the host sync, and what it reads of them."""

    shadow_D: Tensor       # [D] bool: the slots that hold a shadowed expert
    slots: HostValue       # those slots, ascending
    counts: HostValue      # this rank's kept routes to each


class ShadowWeights(torch.autograd.Function):
    """Forward: the shadowed experts' stacked tensors on every rank of ``group`` (one all-reduce each
    owner fills); backward: their gradients summed, the owner's rows to it."""

    @staticmethod
    def forward(ctx, slot_X: Tensor, first_slot: int, owns: bool, group: Optional[dist.ProcessGroup],
                *stacked: Tensor):
        L, n = stacked[0].shape[0], slot_X.numel()
        widths = [t[0].numel() for t in stacked]
        local_X = slot_X - first_slot
        mine_X = (local_X >= 0) & (local_X < L)
        if owns:
            pick_X = local_X.clamp(0, L - 1)
            buf_DX = torch.cat([t[pick_X].reshape(n, -1) for t in stacked], dim=1)
            buf_DX.masked_fill_(~mine_X[:, None], 0)
        else:
            buf_DX = stacked[0].new_zeros(n, sum(widths))
        if group is not None:
            dist.all_reduce(buf_DX, group=group)
        ctx.save_for_backward(torch.where(mine_X, local_X, L))     # row L: a spare for the others
        ctx.owns, ctx.group, ctx.shapes, ctx.widths = owns, group, [t.shape for t in stacked], widths
        return tuple(part.reshape(n, *shape[1:]).contiguous()
                     for part, shape in zip(buf_DX.split(widths, dim=1), ctx.shapes))

    @staticmethod
    def backward(ctx, *grads_D: Tensor):
        (row_X,) = ctx.saved_tensors
        n = len(grads_D[0])                     # autograd gives zeros for an output without gradient
        buf_DX = torch.cat([g.reshape(n, -1) for g in grads_D], dim=1)
        if ctx.group is not None:
            dist.all_reduce(buf_DX, group=ctx.group)
        if not ctx.owns:
            return (None,) * (4 + len(grads_D))
        out = []
        for part, shape, width in zip(buf_DX.split(ctx.widths, dim=1), ctx.shapes, ctx.widths):
            L = shape[0]
            out.append(buf_DX.new_zeros(L + 1, width).index_copy_(0, row_X, part)[:L].view(shape))
        return (None, None, None, None, *out)


class ShadowExperts:
    """The shadowed experts of one layer, next to its ``GroupedExperts``: their ids (not saved) and
    their copies, fetched from the owners over ``group``."""

    def __init__(self, experts: "GroupedExperts", group: Optional[dist.ProcessGroup]):
        self.experts = experts
        self.group = group
        self.expert_ids: tuple[int, ...] = ()
        self._ids_X: Optional[Tensor] = None      # the ids on the placement's device, made once per ``set``

    def set(self, expert_ids) -> None:
        """Shadow these experts (global ids; empty: none). The same on every EP rank."""
        given = [int(e) for e in expert_ids]
        ids = sorted(set(given))
        E = self.experts.num_experts
        if len(ids) != len(given) or any(not 0 <= e < E for e in ids):
            raise ValueError(f"shadowed experts must be distinct ids in 0..{E - 1}, got {given}")
        self.expert_ids = tuple(ids)
        self._ids_X = None

    def slots(self) -> tuple[Tensor, Tensor]:
        """([D] bool: the slots that hold a shadowed expert, those slots ascending)."""
        placement_E = self.experts.placement
        if self._ids_X is None or self._ids_X.device != placement_E.device:
            self._ids_X = torch.tensor(self.expert_ids, dtype=torch.long, device=placement_E.device)
        slot_X = torch.sort(placement_E[self._ids_X]).values
        shadow_D = torch.zeros(placement_E.numel(), dtype=torch.bool, device=placement_E.device)
        shadow_D[slot_X] = True
        return shadow_D, slot_X

    def __call__(self, x_TH: Tensor, routes: ShadowRoutes) -> Tensor:
        """The rows ``routes`` of this rank's tokens through copies of the shadowed experts -> [R, H]."""
        e = self.experts
        owns = any(e.first_slot <= s < e.first_slot + e.num_local for s in routes.slots.host)
        copies = ShadowWeights.apply(routes.slots.device, e.first_slot, owns, self.group,
                                     *(t.to(x_TH.dtype) for t in e.stacked()))
        return e.ffn(x_TH, routes.counts, routes.token_R, *copies[:2], False, *copies[2:])


class Shadowing:
    """Shadow experts as a transform of the routing plan: ``before`` the host sync, ``split`` the
    shadowed routes out of the plan the wire format sends, ``combine`` their rows, computed here."""

    def __init__(self, shadow: ShadowExperts):
        self.shadow = shadow

    def before(self, plan: RoutingPlan, sync: HostSync) -> Held:
        shadow_D, slot_X = self.shadow.slots()
        return Held(shadow_D, sync.add(slot_X), sync.add(plan.kept_D[slot_X]))

    def split(self, plan: RoutingPlan, held: Held) -> tuple[RoutingPlan, ShadowRoutes]:
        """After the host sync: (the plan of the exchanged routes, the routes kept here). No host sync."""
        slot_R, n = plan.slot_R(), sum(held.counts.host)
        order_R = stable_partition(torch.arange(slot_R.numel(), device=slot_R.device), held.shadow_D[slot_R])
        shadowed_R, exchanged_R = order_R[:n], order_R[n:]
        routes = ShadowRoutes(slots=held.slots, counts=RowCounts(held.counts.host, held.counts.device),
                              token_R=plan.token_R[shadowed_R], gate_R=plan.gate_R[shadowed_R],
                              route_R=plan.route_R[shadowed_R])
        exchanged = replace(plan, route_R=plan.route_R[exchanged_R], token_R=plan.token_R[exchanged_R],
                            gate_R=plan.gate_R[exchanged_R], kept_D=plan.kept_D.masked_fill(held.shadow_D, 0))
        return exchanged, routes

    def combine(self, y_RH: Tensor, state) -> Tensor:
        """One combine over the exchanged rows and the shadowed routes' rows (``state.held``)."""
        ex, sh = state.plan, state.held
        y_shadow_RH = self.shadow(state.x_TH, sh)
        return gate_combine(torch.cat([y_RH, y_shadow_RH]), torch.cat([ex.gate_R, sh.gate_R]),
                            torch.cat([ex.token_R, sh.token_R]), torch.cat([ex.route_R, sh.route_R]),
                            ex.num_tokens, ex.k)

