"""The wire format's interface: how one batch's sizes and rows cross to the experts and back.
``LocalWire`` here (one process), ``counts_wire``, ``padded_wire``, ``token_wire``; a batch's state is
a frozen ``Dispatch`` (``Exchange`` under EP). Shape suffixes: see ``moe_plugin.layers``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import Tensor

from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.router import FiniteCheck, RoutingPlan

if TYPE_CHECKING:
    from moe_plugin.layers.shadow import ShadowRoutes


class Wire(Protocol):
    """A wire format. The dispatcher calls ``for_batch``, ``sizes`` and (after the host sync)
    ``state``; the schedule ``send`` and ``back``."""

    def for_batch(self, x_TH: Tensor, plan: RoutingPlan) -> "Wire":
        """The wire format of this batch: itself, or one it falls back to."""

    def sizes(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], sync: HostSync,
              held_D: Optional[Tensor] = None) -> Any:
        """Add what the host sync reads to ``sync``; ``held_D`` [D] bool: shadowed slots, not sent."""

    def state(self, x_TH: Tensor, plan: RoutingPlan, sizes: Any) -> "Dispatch":
        """The batch's state once ``sync`` is read; ``plan``: the routes it sends."""

    def send(self, state: "Dispatch") -> tuple[Tensor, Tensor, RowCounts]:
        """``(x_NH, gather_R, counts_L)``: the experts' rows ``x_NH[gather_R]``, by local expert."""

    def back(self, y_RH: Tensor, state: "Dispatch") -> Tensor:
        """The experts' outputs back on this rank, in the plan's kept-route order."""


@dataclass(frozen=True)
class Dispatch:
    """One batch as the dispatcher sends it: the tokens and their checked routing."""

    x_TH: Tensor
    plan: RoutingPlan
    counts_L: RowCounts      # rows per local expert, on the host and on the device
    wire: Wire               # the batch's wire format (``for_batch``)
    traffic_PD: Optional[Tensor] = None   # [P, D] kept routes of each EP peer's tokens per slot (None: not learnt)


@dataclass(frozen=True, kw_only=True)
class Exchange(Dispatch):
    """``Dispatch`` under expert parallelism: what the way back needs (a wire format's own fields
    are in its subclass), shadowing's routes and the chunked schedule's split."""

    send_splits: list[int]          # [P] routes to each EP peer
    recv_splits: list[int]          # [P] routes from each EP peer
    unsort_R: Tensor                # the experts' (expert, sender) order -> received (sender, expert) order
    held: Optional["ShadowRoutes"] = None  # the routes shadowing kept here (``shadow.py``)
    chunks: Any = None                     # the chunked schedule's split (``overlapped.Chunks``)


@dataclass(eq=False)
class LocalSizes:
    """What ``LocalWire`` reads in the host sync."""

    send: HostValue          # [D] kept routes per slot: all to the local experts


class LocalWire:
    """The wire format of one process: the local experts are the slots, their rows the tokens at
    ``plan.token_R`` (the experts gather them chunk by chunk: no [R, H] copy is kept)."""

    def for_batch(self, x_TH: Tensor, plan: RoutingPlan) -> "LocalWire":
        return self

    def sizes(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck], sync: HostSync,
              held_D: Optional[Tensor] = None) -> LocalSizes:
        sizes = LocalSizes(sync.add(plan.kept_D))
        sync.check(finite)
        return sizes

    def state(self, x_TH: Tensor, plan: RoutingPlan, sizes: LocalSizes) -> Dispatch:
        return Dispatch(x_TH, plan, RowCounts(sizes.send.host, plan.kept_D), self)

    def send(self, state: Dispatch) -> tuple[Tensor, Tensor, RowCounts]:
        return state.x_TH, state.plan.token_R, state.counts_L

    def back(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        return y_RH
