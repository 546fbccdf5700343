"""The counts wire format: the kept routes per slot exchanged first, then exactly the kept rows; and
the permutations the other expert-parallel wire formats reuse. Shape suffixes: see
``moe_plugin.layers``; step by step: docs/design/layers_exchange.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moe_plugin.layers import comm
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import FiniteCheck, RoutingPlan
from moe_plugin.layers.wire import Exchange


@dataclass(frozen=True, kw_only=True)
class CountsExchange(Exchange):
    """``Exchange`` of the counts wire format."""

    etp_splits: list[int]    # [Q] rows each ETP peer received over EP (its block of the gather)
    sort_R: Tensor           # received (sender, expert) order -> (expert, sender) order


@dataclass(eq=False)
class Sizes:
    """What the counts round planned, on the device, and what the host sync reads of it."""

    traffic_PD: Tensor
    send_PL: Tensor            # rows to each EP peer per local slot of it
    recv_PL: Tensor            # rows from each EP peer per local slot
    counts_GL: Tensor          # rows per (sender, local slot), ETP peer major
    send: HostValue            # [P] rows to each EP peer
    recv: HostValue            # [P] rows from each EP peer
    etp: HostValue             # [Q] rows each ETP peer received
    counts_L: HostValue        # rows per local expert
    from_peers: Optional[HostValue] = None   # what each EP peer added per peer (``to_peers_P``), mine


def source_to_expert_order(counts_GL: Tensor, total: int | None = None) -> tuple[Tensor, Tensor]:
    """For rows in blocks ``(g, l)`` of ``counts_GL[g, l]`` rows (sender major): ``rows[sort]`` lists
    the blocks ``(l, g)``, ``sorted[unsort]`` undoes it. ``total`` (the rows, if known) saves a host sync."""
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
    """For a plan's ``R`` listed routes (kept first, by slot): each one's slot (dropped: the last),
    its place in its slot, and whether it is kept. No host sync."""
    end_D = torch.cumsum(kept_D, 0)
    r_R = torch.arange(R, device=kept_D.device)
    slot_R = torch.searchsorted(end_D, r_R, right=True).clamp(max=kept_D.numel() - 1)
    return slot_R, r_R - (end_D - kept_D)[slot_R], r_R < end_D[-1]


def flag_rides(finite: Optional[FiniteCheck], parallel: LayerParallelism) -> bool:
    """Whether the router's finite flag rides with the sizes (the EP group is every token rank)."""
    return finite is not None and finite.group is None and parallel.ep_is_tokens


class CountsWire:
    """The counts wire format (module docstring)."""

    def __init__(self, parallel: LayerParallelism, num_local: int):
        self.parallel, self.num_local = parallel, num_local

    def for_batch(self, x_TH: Tensor, plan: RoutingPlan) -> "CountsWire":
        return self

    def sizes(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], sync: HostSync,
              held_D: Optional[Tensor] = None, to_peers_P: Optional[Tensor] = None) -> Sizes:
        """The counts round, added to ``sync``; shadowed slots (``held_D``) are counted in ``traffic_PD``,
        not sent. ``to_peers_P``: one integer per EP peer riding along (``Sizes.from_peers``: mine)."""
        p, kept_D = self.parallel, plan.kept_D
        D, carried = kept_D.numel(), flag_rides(finite, p)
        extra = ([] if to_peers_P is None else [to_peers_P]) + ([finite.bad_1] if carried else [])
        gathered = comm.gather_counts(torch.cat([kept_D] + [x.to(kept_D.dtype) for x in extra]), p.ep)
        traffic_PD = gathered[:, :D].contiguous()
        send_D, sent_PD = kept_D, traffic_PD
        if held_D is not None:
            send_D, sent_PD = kept_D.masked_fill(held_D, 0), traffic_PD.masked_fill(held_D, 0)
        send_PL = send_D.view(p.ep_size, self.num_local)
        recv_PL = sent_PD[:, p.ep_rank * self.num_local:(p.ep_rank + 1) * self.num_local].contiguous()
        if p.etp is not None:
            mine_QX = recv_PL.reshape(1, -1).repeat(p.etp_size, 1)
            counts_GL = comm.exchange_counts(mine_QX, p.etp).view(-1, self.num_local)
        else:
            counts_GL = recv_PL
        sizes = Sizes(traffic_PD, send_PL, recv_PL, counts_GL, send=sync.add(send_PL.sum(1)),
                      recv=sync.add(recv_PL.sum(1)), etp=sync.add(counts_GL.view(p.etp_size, -1).sum(1)),
                      counts_L=sync.add(counts_GL.sum(0)))
        sync.check(finite, gathered[:, -1] if carried else None, p.ep)
        if to_peers_P is not None:
            sizes.from_peers = sync.add(gathered[:, D + p.ep_rank])
        return sizes

    def state(self, x_TH: Tensor, plan: RoutingPlan, sizes: Sizes) -> CountsExchange:
        """The batch's exchange, with the permutation that re-sorts the received rows."""
        sort_R, unsort_R = source_to_expert_order(sizes.counts_GL, total=sum(sizes.etp.host))
        return CountsExchange(x_TH, plan, RowCounts(sizes.counts_L.host, sizes.counts_L.device), wire=self,
                              traffic_PD=sizes.traffic_PD, send_splits=sizes.send.host, recv_splits=sizes.recv.host,
                              etp_splits=sizes.etp.host, sort_R=sort_R, unsort_R=unsort_R)

    def send(self, state: CountsExchange) -> tuple[Tensor, Tensor, RowCounts]:
        p = self.parallel
        x_RH = comm.all_to_all(state.x_TH.index_select(0, state.plan.token_R), state.recv_splits,
                               state.send_splits, p.ep)
        x_RH = comm.gather_rows(x_RH, state.etp_splits, p.etp)
        return x_RH, state.sort_R, state.counts_L      # the experts gather the re-sorted rows themselves

    def back(self, y_RH: Tensor, state: CountsExchange) -> Tensor:
        y_RH = comm.reduce_scatter_rows(y_RH.index_select(0, state.unsort_R), state.etp_splits, self.parallel.etp)
        return comm.all_to_all(y_RH, state.send_splits, state.recv_splits, self.parallel.ep)
