"""The overlapped schedule (``overlap_chunks`` > 1, FasterMoE's smart scheduling): the counts exchange
in chunks of local experts, overlapped with the experts and the shared expert; outputs and gradients
bit-identical to one exchange. Without ETP or shadowed experts. Shape suffixes: see
``moe_plugin.layers``; the order of the collectives: docs/design/layers_exchange.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moe_plugin.layers import comm
from moe_plugin.layers.counts_wire import Sizes, source_to_expert_order
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.schedule import Scopes
from moe_plugin.layers.wire import Exchange

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts


@dataclass(frozen=True)
class ExchangeChunk:
    """Local experts ``[l0, l1)`` and their part of the exchange."""

    l0: int
    l1: int
    send_splits: list[int]   # [P] rows to each EP peer
    recv_splits: list[int]   # [P] rows from each EP peer
    counts_L: RowCounts      # rows per local expert of the chunk
    sort_R: Tensor           # the chunk's received (sender, expert) order -> (expert, sender) order
    unsort_R: Tensor         # its inverse


@dataclass(frozen=True)
class Chunks:
    """The exchange of one batch cut into chunks (``Exchange.chunks``)."""

    chunks: list[ExchangeChunk]
    order_R: Tensor          # kept routes in chunk order (indices into the plan's routes)
    unorder_R: Tensor        # its inverse


def chunk_bounds(num_local: int, n: int) -> list[tuple[int, int]]:
    """``n`` consecutive ranges of local experts, sizes differing by at most one."""
    sizes = [num_local // n + (i < num_local % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [(s, s + size) for s, size in zip(starts, sizes)]


def chunked(state: Exchange, n: int, send_PL: list[int], recv_PL: list[int], recv_dev_PL: Tensor) -> Chunks:
    """``state`` cut into ``n`` chunks from the rows to / from each peer per local slot (read at the
    layer's host sync; ``recv_dev_PL`` on the device). No host sync, no host-to-device copy."""
    P = len(state.send_splits)
    L = len(send_PL) // P
    device = state.plan.kept_D.device
    chunks, chunk_L = [], torch.empty(L, dtype=torch.long, device=device)
    for i, (l0, l1) in enumerate(chunk_bounds(L, n)):
        chunk_L[l0:l1] = i
        send = [sum(send_PL[p * L + l0:p * L + l1]) for p in range(P)]
        recv = [sum(recv_PL[p * L + l0:p * L + l1]) for p in range(P)]
        sort_R, unsort_R = source_to_expert_order(recv_dev_PL[:, l0:l1], total=sum(recv))
        chunks.append(ExchangeChunk(l0, l1, send, recv, state.counts_L[l0:l1], sort_R, unsort_R))
    order_R = torch.sort(chunk_L[state.plan.slot_R() % L], stable=True).indices
    unorder_R = torch.empty_like(order_R)
    unorder_R[order_R] = torch.arange(order_R.numel(), device=device)
    return Chunks(chunks, order_R, unorder_R)


class Overlapped:
    """``dispatch`` starts every chunk's all-to-all, ``experts`` runs each chunk once its rows arrived
    and starts its way back, ``back`` waits for them all."""

    scopes = Scopes(*["moe.overlapped"] * 4)
    overlaps_shared = True

    def __init__(self, parallel: LayerParallelism, chunks: int):
        self.parallel, self.chunks = parallel, chunks

    def plan(self, sizes: Sizes, sync: HostSync) -> tuple[HostValue, HostValue]:
        """The rows to and from each peer per local slot join the host sync."""
        return sync.add(sizes.send_PL), sync.add(sizes.recv_PL)

    def finish(self, state: Exchange, pending: tuple[HostValue, HostValue]) -> Exchange:
        send, recv = pending
        return replace(state, chunks=chunked(state, self.chunks, send.host, recv.host, recv.device))

    def dispatch(self, state: Exchange) -> list[tuple]:
        chunks, plan = state.chunks.chunks, state.plan
        # route order first, then chunk order: backward sums a token's routes' gradients in route order
        # as one exchange does (one gather by the composed index would sum them chunk by chunk)
        x_RH = state.x_TH.index_select(0, plan.token_R).index_select(0, state.chunks.order_R)
        sends = x_RH.split([sum(c.send_splits) for c in chunks])
        return [comm.start_all_to_all(x_CH, c.recv_splits, c.send_splits, self.parallel.ep)
                for x_CH, c in zip(sends, chunks)]

    def experts(self, started: list[tuple], state: Exchange, experts: "GroupedExperts") -> list[tuple]:
        chunks, group = state.chunks.chunks, self.parallel.ep
        weights = experts.split_weights([c.l1 - c.l0 for c in chunks], state.x_TH.dtype)
        back = []
        for c, s, (w1_LHF1, w2_LFH, b1_LF1, b2_LH) in zip(chunks, started, weights):
            y_CH = experts.ffn(comm.wait_all_to_all(s), c.counts_L, c.sort_R, w1_LHF1, w2_LFH, False, b1_LF1, b2_LH)
            y_CH = y_CH.index_select(0, c.unsort_R)
            back.append(comm.start_all_to_all(y_CH, c.send_splits, c.recv_splits, group))
        return back

    def back(self, back: list[tuple], state: Exchange) -> Tensor:
        return torch.cat([comm.wait_all_to_all(b) for b in back]).index_select(0, state.chunks.unorder_R)
