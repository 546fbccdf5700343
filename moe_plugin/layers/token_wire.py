"""The token wire format (``moe.exchange`` token): each token sent once per destination EP rank with
the mask of its slots there; the counts format's outputs, the weight gradients equal to rounding.
Shape suffixes: see ``moe_plugin.layers``; U the unique (rank, token) rows, X in ``mask_XY`` the pairs
and a spare row, Y the mask columns, X in ``send_UX`` H + Y. The masks: docs/design/layers_exchange.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moe_plugin.layers import comm
from moe_plugin.layers.counts_wire import CountsWire, Sizes, route_slots, source_to_expert_order
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.padded_wire import header_digits
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import FiniteCheck, RoutingPlan
from moe_plugin.layers.wire import Exchange


def mask_bits(dtype: torch.dtype) -> int:
    """Bits of a slot mask one column of ``dtype`` holds exactly (fp32 24, bf16 8, fp16 11)."""
    return header_digits(dtype, 0)[0].bit_length() - 1


@dataclass(frozen=True, kw_only=True)
class TokenExchange(Exchange):
    """``Exchange`` with unique rows (``send_splits`` / ``recv_splits`` count routes, for the way back)."""

    row_send: list[int]      # [P] unique rows to each peer
    row_recv: list[int]      # [P] unique rows from each peer
    send_UX: Tensor          # the rows with their mask columns
    back_R: Tensor           # the sender's (slot, token) order -> kept-route order


@dataclass(eq=False)
class TokenSizes:
    """The counts round's sizes, the unique rows to each peer and the (peer, token) masks."""

    counts: Sizes
    send: HostValue          # [P] routes to each EP peer (``counts.send``)
    row_send: HostValue      # [P] unique rows to each EP peer
    used_X: Tensor           # [P * T] which (peer, token) pairs are sent
    mask_XY: Tensor          # their slot masks (and a spare row)


class TokenWire:
    """The token wire format: each token sent once per destination rank (module docstring)."""

    def __init__(self, parallel: LayerParallelism, num_local: int):
        self.parallel, self.num_local = parallel, num_local
        self.counts = CountsWire(parallel, num_local)

    def for_batch(self, x_TH: Tensor, plan: RoutingPlan) -> "TokenWire":
        return self

    def sizes(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], sync: HostSync,
              held_D: Optional[Tensor] = None) -> TokenSizes:
        P, L, T = self.parallel.ep_size, self.num_local, plan.num_tokens
        bits = mask_bits(x_TH.dtype)
        Y = -(-L // bits)
        kept_D = plan.kept_D
        slot_R, _, kept_R = route_slots(kept_D, plan.route_R.numel())
        key_R = torch.where(kept_R, (slot_R // L) * T + plan.token_R, P * T)   # dropped: a spare row
        local_R = slot_R % L
        mask_XY = kept_D.new_zeros(P * T + 1, Y).index_put_((key_R, local_R // bits), 2 ** (local_R % bits),
                                                             accumulate=True)   # distinct slots: sum = or
        used_X = mask_XY[:P * T].sum(1) > 0
        rows_P = used_X.view(P, T).sum(1)
        counts = self.counts.sizes(x_TH, plan, finite, sync, to_peers_P=rows_P)
        return TokenSizes(counts, counts.send, sync.add(rows_P), used_X, mask_XY)

    def state(self, x_TH: Tensor, plan: RoutingPlan, sizes: TokenSizes) -> TokenExchange:
        """The unique rows with their masks, and the way back's permutation ``back_R``."""
        c = sizes.counts
        _, unsort_R = source_to_expert_order(c.counts_GL, total=sum(c.etp.host))
        T, U = plan.num_tokens, sum(sizes.row_send.host)
        row_U = torch.nonzero_static(sizes.used_X, size=U).view(-1)             # (p, token) order
        send_UX = torch.cat([x_TH.index_select(0, row_U % T), sizes.mask_XY.index_select(0, row_U).to(x_TH.dtype)], 1)
        key_R = plan.slot_R() * T + plan.token_R
        back_R = torch.empty_like(key_R)
        back_R[torch.argsort(key_R)] = torch.arange(key_R.numel(), device=key_R.device)
        return TokenExchange(x_TH, plan, RowCounts(c.counts_L.host, c.counts_L.device), wire=self,
                             traffic_PD=c.traffic_PD, send_splits=c.send.host, recv_splits=c.recv.host,
                             unsort_R=unsort_R, row_send=sizes.row_send.host, row_recv=c.from_peers.host,
                             send_UX=send_UX, back_R=back_R)

    def send(self, state: TokenExchange) -> tuple[Tensor, Tensor, RowCounts]:
        H, L = state.x_TH.shape[1], self.num_local
        recv_UX = comm.all_to_all(state.send_UX, state.row_recv, state.row_send, self.parallel.ep)
        bits = mask_bits(recv_UX.dtype)
        l_L = torch.arange(L, device=recv_UX.device)
        mask_UY = recv_UX[:, H:].detach().long()
        goes_LU = ((mask_UY[:, l_L // bits] >> (l_L % bits)) & 1).t().reshape(-1)
        gather_R = torch.nonzero_static(goes_LU, size=sum(state.counts_L.host)).view(-1) % recv_UX.shape[0]
        return recv_UX[:, :H], gather_R, state.counts_L

    def back(self, y_RH: Tensor, state: TokenExchange) -> Tensor:
        y_RH = comm.all_to_all(y_RH.index_select(0, state.unsort_R), state.send_splits, state.recv_splits,
                               self.parallel.ep)
        return y_RH.index_select(0, state.back_R)
