"""Expert-parallel token dispatcher: counts exchange, uneven all-to-all, ETP gather, local re-sort.

Shape suffixes: see ``moe_plugin.layers``.

``ExpertParallelDispatcher`` overrides the hooks of ``TokenDispatcher``; permute, gate
weighting and unpermute stay there. Per batch (``prepare``), on the routing plan of this rank's
own tokens, it builds the batch's ``Exchange``:

1. ``send_PL = kept_D.view(P, L)``: the rows of slot ``p * L + l`` go to EP peer p. Slots are
   the placement's order (``placement/``): EP rank p hosts the experts in slots
   ``[p * L, (p + 1) * L)``, the router already sorted the routes by slot.
2. ``traffic_PD = gather_counts(kept_D, ep)``: every peer's kept routes per slot, one all-gather
   of P * E integers; ``recv_PL`` (the rows each peer sends per local slot) is its column block.
   The whole sender x slot matrix comes with it: the load record of ``placement/`` reads it
   from ``Exchange.traffic_PD`` (``traffic``) at no extra cost. When the EP group is exactly the ranks that
   route distinct tokens (``LayerParallelism.ep_is_tokens``), every rank's finite flag rides
   along as one more integer, and the router starts no collective of its own.
3. With ETP, every ETP peer's ``recv_PL`` (``exchange_counts`` of the flattened counts, one row
   per peer) -> ``counts_GL`` [Q * P, L]. Without ETP ``counts_GL = recv_PL``.
4. One ``.tolist()`` of the split sizes, the rows per local expert and the router's finite
   flags (the layer's one host sync; a rank whose logits are not finite makes every rank that
   shares the verdict raise here, before any row moves); the router's plan is cut to its kept
   routes (as many as the rows sent), and the permutation that re-sorts
   received rows from (sender, local expert) order to (local expert, sender) order, built with
   tensor ops from ``counts_GL`` (``source_to_expert_order``).

Forward (``to_experts``): gather of the kept routes' tokens, uneven ``all_to_all`` over EP (no
padding; zero rows either way is fine), ``gather_rows`` over ETP; the re-sort is left to the
experts as their row index ``sort_R`` (``GroupedExperts(x, counts, gather_R)``), which gather
chunk by chunk and keep only the received rows for backward. Return path (``from_experts``): the inverse
re-sort, ``reduce_scatter_rows`` over ETP (sums the F-shards' partial outputs, keeps this
rank's received block), the reverse ``all_to_all`` over EP. The collectives' backwards are the
reverse exchanges (``comm.py``). The rows each expert sees are then ordered by sender and,
within a sender, in its priority order.

Shadow experts (``shadow.py``): ``layout(kept_D, finite, shadow_D)`` leaves the routes of the
shadowed slots out of the send and receive counts (they are computed where they are);
``traffic_PD`` still counts them, so the load record does not depend on shadowing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moe_plugin.layers import comm
from moe_plugin.layers.dispatcher import Dispatch, TokenDispatcher
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import FiniteCheck, RoutingPlan


@dataclass(frozen=True)
class Exchange(Dispatch):
    """One batch as ``ExpertParallelDispatcher`` sends it: the tokens, the routes that go
    through the exchange (``plan``) and the exchange layout."""

    traffic_PD: Optional[Tensor]   # [P, D] kept routes of each EP peer's tokens per slot (None: ``padded.py``)
    send_splits: list[int]   # [P] rows to each EP peer
    recv_splits: list[int]   # [P] rows from each EP peer
    etp_splits: list[int]    # [Q] rows each ETP peer received over EP (its block of the gather)
    sort_R: Tensor           # received (sender, expert) order -> (expert, sender) order
    unsort_R: Tensor         # its inverse


def source_to_expert_order(counts_GL: Tensor, total: int | None = None) -> tuple[Tensor, Tensor]:
    """Permutation for rows laid out in blocks ``(g, l)`` (sender major, ``counts_GL[g, l]`` rows
    each): ``rows[sort]`` lists the blocks ``(l, g)`` (local expert major), ``sorted[unsort]``
    undoes it. No Python loop over rows or blocks; ``total`` (the number of rows, when known)
    saves a host sync."""
    blocks_GL = counts_GL.long()
    sizes_LG = blocks_GL.t().reshape(-1)                        # block sizes in target order
    start_src_LG = (torch.cumsum(blocks_GL.reshape(-1), 0) - blocks_GL.reshape(-1)).view_as(blocks_GL).t().reshape(-1)
    start_dst_LG = torch.cumsum(sizes_LG, 0) - sizes_LG
    total = int(sizes_LG.sum()) if total is None else total
    row_R = torch.arange(total, device=counts_GL.device)
    shift_R = torch.repeat_interleave(start_src_LG - start_dst_LG, sizes_LG, output_size=total)
    sort_R = row_R + shift_R
    unsort_R = torch.empty_like(sort_R)
    unsort_R[sort_R] = row_R
    return sort_R, unsort_R


def route_slots(kept_D: Tensor, R: int) -> tuple[Tensor, Tensor, Tensor]:
    """For the ``R`` routes a plan lists (the kept ones first, sorted by slot, ``kept_D`` per slot):
    each route's slot, its place among its slot's routes, and whether it is kept (the dropped
    ones get the last slot). No host sync."""
    end_D = torch.cumsum(kept_D, 0)
    r_R = torch.arange(R, device=kept_D.device)
    slot_R = torch.searchsorted(end_D, r_R, right=True).clamp(max=kept_D.numel() - 1)
    return slot_R, r_R - (end_D - kept_D)[slot_R], r_R < end_D[-1]


def cut(values: list, *sizes: int) -> list[list]:
    """``values`` cut into consecutive pieces of ``sizes``, and what is left as one more piece."""
    pieces, start = [], 0
    for n in sizes:
        pieces.append(values[start:start + n])
        start += n
    return pieces + [values[start:]]


class ExpertParallelDispatcher(TokenDispatcher):
    """Dispatcher for experts spread over ``parallel.ep`` and split over ``parallel.etp``."""

    def __init__(self, num_experts: int, parallel: LayerParallelism):
        super().__init__(num_experts)
        if num_experts % parallel.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {parallel.ep_size} "
                             "expert-parallel ranks")
        self.parallel = parallel
        self.num_local = num_experts // parallel.ep_size

    def prepare(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck] = None) -> Exchange:
        layout, _ = self.layout(plan.kept_D, finite)
        return Exchange(x_TH, plan.kept(sum(layout["send_splits"])), **layout)

    def layout(self, kept_D: Tensor, finite: Optional[FiniteCheck] = None, shadow_D: Optional[Tensor] = None,
               extra_X: Optional[Tensor] = None, per_slot: bool = False,
               to_peers_P: Optional[Tensor] = None) -> tuple[dict, list[int]]:
        """The layout fields of an ``Exchange`` for this rank's kept routes per slot, after the
        finite verdict, and ``extra_X`` (integers the caller needs on the host too, read in the
        same transfer) as a list. ``shadow_D`` (bool [D], the same on every EP rank): slots whose
        routes every rank computes itself (``shadow.py``); counted in ``traffic_PD``, not exchanged.
        ``per_slot``: the list starts with the rows to and from each peer per local slot
        (``send_PL``, ``recv_PL`` flattened; ``overlap.py``). ``to_peers_P``: one more integer per
        EP peer that rides along with the counts (``token.py``: its rows to each peer); the list
        then starts with what each peer sent this rank."""
        p = self.parallel
        D = kept_D.numel()
        X = 0 if to_peers_P is None else p.ep_size
        payload = [kept_D] if to_peers_P is None else [kept_D, to_peers_P.to(kept_D.dtype)]
        if finite is not None and finite.group is None and p.ep_is_tokens:
            # The finite flag rides along with the counts: the EP group is every rank that
            # routes distinct tokens, so this exchange is the agreement, at no extra cost.
            gathered = comm.gather_counts(torch.cat(payload + [finite.bad_1.to(kept_D.dtype)]), p.ep)
            flags_P, flag_group = gathered[:, D + X], p.ep
        else:
            gathered = comm.gather_counts(torch.cat(payload), p.ep) if X else comm.gather_counts(kept_D, p.ep)
            flags_P = finite.flags() if finite is not None else gathered.new_zeros(0)
            flag_group = finite.group if finite is not None else None
        traffic_PD = gathered[:, :D].contiguous() if gathered.shape[1] > D else gathered
        from_peers_P = gathered[:, D + p.ep_rank] if X else None
        send_D, sent_PD = kept_D, traffic_PD
        if shadow_D is not None:
            send_D, sent_PD = kept_D.masked_fill(shadow_D, 0), traffic_PD.masked_fill(shadow_D, 0)
        send_PL = send_D.view(p.ep_size, self.num_local)
        recv_PL = sent_PD[:, p.ep_rank * self.num_local:(p.ep_rank + 1) * self.num_local].contiguous()
        if p.etp is not None:
            mine_QX = recv_PL.reshape(1, -1).repeat(p.etp_size, 1)
            counts_GL = comm.exchange_counts(mine_QX, p.etp).view(-1, self.num_local)
        else:
            counts_GL = recv_PL
        counts_dev_L = counts_GL.sum(0)
        parts = [send_PL.sum(1), recv_PL.sum(1), counts_GL.view(p.etp_size, -1).sum(1), counts_dev_L, flags_P]
        extras = ([send_PL.reshape(-1), recv_PL.reshape(-1)] if per_slot else []) + [from_peers_P]
        host = torch.cat([t.to(send_PL.dtype) for t in parts + extras + [extra_X] if t is not None])
        host = host.tolist()                                              # the one sync
        send, recv, etp, counts_L, flags, extra = cut(host, *(t.numel() for t in parts))
        if finite is not None:
            finite.verdict(flags, flag_group)                             # before any row leaves
        sort_R, unsort_R = source_to_expert_order(counts_GL, total=sum(etp))
        return dict(traffic_PD=traffic_PD, send_splits=send, recv_splits=recv, etp_splits=etp,
                    counts_L=RowCounts(counts_L, counts_dev_L),
                    sort_R=sort_R, unsort_R=unsort_R), extra

    def to_experts(self, state: Exchange) -> tuple[Tensor, Tensor, RowCounts]:
        p = self.parallel
        x_RH = comm.all_to_all(state.x_TH.index_select(0, state.plan.token_R), state.recv_splits,
                               state.send_splits, p.ep)
        x_RH = comm.gather_rows(x_RH, state.etp_splits, p.etp)
        return x_RH, state.sort_R, state.counts_L      # the experts gather the re-sorted rows themselves

    def from_experts(self, y_RH: Tensor, state: Exchange) -> Tensor:
        y_RH = y_RH.index_select(0, state.unsort_R)
        y_RH = comm.reduce_scatter_rows(y_RH, state.etp_splits, self.parallel.etp)
        return comm.all_to_all(y_RH, state.send_splits, state.recv_splits, self.parallel.ep)

    def traffic(self, state: Exchange) -> Tensor:
        return state.traffic_PD
