"""The padded wire format (``moe.exchange`` padded): capacity blocks with a counts header, one equal
all-to-all and no counts round; the counts format's outputs and gradients, bit for bit, but no
sender x slot traffic. A header the hidden size cannot hold: forced raises, ``auto`` sends that batch
with counts. Shape suffixes: see ``moe_plugin.layers`` (N: the rows of a padded buffer); the blocks:
docs/design/layers_exchange.md.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_plugin.configs.errors import ConfigError
from moe_plugin.layers import comm
from moe_plugin.layers.counts_wire import CountsWire, flag_rides, route_slots, source_to_expert_order
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import FiniteCheck, RoutingPlan
from moe_plugin.layers.wire import Exchange

logger = logging.getLogger(__name__)


@functools.cache
def log_choice(mode: str, why_not: Optional[str]) -> None:
    """The ``auto`` exchange's choice, logged once."""
    logger.info("moe.exchange auto: %s%s", mode, f" ({why_not})" if why_not else " (gloo, capacity-bound rows)")


def header_digits(dtype: torch.dtype, capacity: int) -> tuple[int, int]:
    """(base, digits): every count 0..``capacity`` written in ``digits`` digits of ``base``, each
    an integer ``dtype`` holds exactly."""
    base = min(int(2 / torch.finfo(dtype).eps), 2 ** 24)    # 2^(mantissa bits + 1): 2^24 fp32, 256 bf16
    digits = 1
    while base ** digits <= capacity:
        digits += 1
    return base, digits


@dataclass(frozen=True, kw_only=True)
class PaddedExchange(Exchange):
    """``Exchange`` whose rows arrived padded: ``recv_NH`` [P * B, H], the experts' rows ``recv_NH[gather_R]``."""

    recv_NH: Tensor
    gather_R: Tensor


@dataclass(eq=False)
class PaddedSizes:
    """The received blocks and what the host sync reads of their headers."""

    recv_NH: Tensor
    recv_PL: Tensor          # rows from each EP peer per local slot, read from the headers
    block: int               # B: rows per peer
    send: HostValue          # [P] rows to each EP peer
    recv: HostValue          # [P] rows from each EP peer
    counts_L: HostValue      # rows per local expert


class PaddedWire:
    """The padded wire format (module docstring); ``forced``: the config asked for it by name, so a
    header that does not fit raises instead of sending the batch with counts."""

    def __init__(self, parallel: LayerParallelism, num_local: int, forced: bool = False):
        self.parallel, self.num_local, self.forced = parallel, num_local, forced
        self.counts = CountsWire(parallel, num_local)

    def for_batch(self, x_TH: Tensor, plan: RoutingPlan):
        """Itself, or counts where the header of this batch does not fit (``auto``)."""
        L, H = self.num_local, x_TH.shape[1]
        _, digits = header_digits(x_TH.dtype, plan.block_capacity)
        if L * digits + 1 <= H:
            return self
        why = (f"its header row needs {L * digits + 1} values ({L} local experts x {digits} {x_TH.dtype} digits "
               f"of capacity {plan.block_capacity}, + 1 flag), the hidden size is {H}")
        if self.forced:
            raise ConfigError("moe.exchange", "padded", f"{why}; use 'counts' or 'auto'")
        log_choice("counts", why)
        return self.counts

    def sizes(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], sync: HostSync,
              held_D: Optional[Tensor] = None) -> PaddedSizes:
        """The blocks go out at once; the host sync reads the headers that came back."""
        p, P, L = self.parallel, self.parallel.ep_size, self.num_local
        base, digits = header_digits(x_TH.dtype, plan.block_capacity)
        B = 1 + L * plan.block_capacity
        send_NH = self._send_buffer(x_TH, plan, finite, B, base, digits)
        recv_NH = comm.all_to_all(send_NH, [B] * P, [B] * P, p.ep)
        head_PX = recv_NH.detach().view(P, B, -1)[:, 0, :L * digits + 1].long()
        powers_X = base ** torch.arange(digits, device=head_PX.device)
        recv_PL = (head_PX[:, :-1].view(P, L, digits) * powers_X).sum(-1)
        counts_dev_L = recv_PL.sum(0)
        sizes = PaddedSizes(recv_NH, recv_PL, B, send=sync.add(plan.kept_D.view(P, L).sum(1)),
                            recv=sync.add(recv_PL.sum(1)), counts_L=sync.add(counts_dev_L))
        sync.check(finite, head_PX[:, -1] if flag_rides(finite, p) else None, p.ep)   # flags came with the headers
        return sizes

    def _send_buffer(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], B: int, base: int,
                     digits: int) -> Tensor:
        """[P * B, H]: per peer the header and the kept routes' rows at their slot's place."""
        P, L, C, H = self.parallel.ep_size, self.num_local, plan.block_capacity, x_TH.shape[1]
        kept_D, R = plan.kept_D, plan.route_R.numel()
        slot_R, within_R, kept_R = route_slots(kept_D, R)
        place_R = torch.where(kept_R, (slot_R // L) * B + 1 + (slot_R % L) * C + within_R,
                              P * B + torch.arange(R, device=kept_D.device))   # dropped: rows left unsent
        powers_X = base ** torch.arange(digits, device=kept_D.device)
        digits_PX = (kept_D.view(P, L, 1) // powers_X % base).view(P, L * digits)
        bad_1 = finite.bad_1 if finite is not None else kept_D.new_zeros(1)
        header_PH = F.pad(torch.cat([digits_PX, bad_1.to(kept_D.dtype).expand(P, 1)], 1).to(x_TH.dtype),
                          (0, H - L * digits - 1))
        rows_XH = torch.cat([x_TH.index_select(0, plan.token_R), header_PH])
        place_X = torch.cat([place_R, torch.arange(P, device=kept_D.device) * B])
        return x_TH.new_zeros(P * B + R, H).index_copy(0, place_X, rows_XH)[:P * B]

    def state(self, x_TH: Tensor, plan: RoutingPlan, sizes: PaddedSizes) -> PaddedExchange:
        """The experts' gather index into the padded rows: (local expert, sender) order."""
        P, L, C, B, recv_PL = self.parallel.ep_size, self.num_local, plan.block_capacity, sizes.block, sizes.recv_PL
        total = sum(sizes.recv.host)
        sort_R, unsort_R = source_to_expert_order(recv_PL, total=total)
        padded_PL = torch.arange(P, device=recv_PL.device)[:, None] * B + 1 + torch.arange(L, device=recv_PL.device) * C
        compact_PL = (torch.cumsum(recv_PL.view(-1), 0) - recv_PL.view(-1)).view(P, L)
        shift_R = torch.repeat_interleave((padded_PL - compact_PL).view(-1), recv_PL.view(-1), output_size=total)
        gather_R = (torch.arange(total, device=recv_PL.device) + shift_R)[sort_R]
        return PaddedExchange(x_TH, plan, RowCounts(sizes.counts_L.host, sizes.counts_L.device), wire=self,
                              send_splits=sizes.send.host, recv_splits=sizes.recv.host, unsort_R=unsort_R,
                              recv_NH=sizes.recv_NH, gather_R=gather_R)

    def send(self, state: PaddedExchange) -> tuple[Tensor, Tensor, RowCounts]:
        return state.recv_NH, state.gather_R, state.counts_L

    def back(self, y_RH: Tensor, state: PaddedExchange) -> Tensor:
        """The counts wire format's way back (both sides know the counts now)."""
        return comm.all_to_all(y_RH.index_select(0, state.unsort_R), state.send_splits, state.recv_splits,
                               self.parallel.ep)
