"""The schedule's interface: when the rows cross, the experts run and the outputs come back.
``OneExchange`` here, ``overlapped.Overlapped`` (chunks); the dispatcher runs ``dispatch``,
``experts`` and ``back`` in the layer's order. Shape suffixes: see ``moe_plugin.layers``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from moe_plugin.layers.host_sync import HostSync
from moe_plugin.layers.wire import Dispatch

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts


@dataclass(frozen=True)
class Scopes:
    """The profiler scope (``record_function``) of each step; ``bench step --parts`` reads them."""

    dispatch: str
    experts: str
    combine: str
    shared_expert: str


class Schedule(Protocol):
    """A schedule. ``overlaps_shared``: the shared expert runs while the rows cross (after
    ``dispatch``), else after the combine."""

    scopes: Scopes
    overlaps_shared: bool

    def plan(self, sizes: Any, sync: HostSync) -> Any:
        """What it reads in the host sync, added to ``sync``."""

    def finish(self, state: Dispatch, pending: Any) -> Dispatch:
        """The batch's state with what it read (``pending``, now on the host)."""

    def dispatch(self, state: Dispatch) -> Any:
        """The rows to the experts (sent, or started)."""

    def experts(self, rows: Any, state: Dispatch, experts: "GroupedExperts") -> Any:
        """The local experts on ``rows``."""

    def back(self, y: Any, state: Dispatch) -> Tensor:
        """The experts' outputs back on this rank, [R, H] in the plan's kept-route order."""


class OneExchange:
    """The schedule of one exchange: every row to the experts, the experts, every row back."""

    scopes = Scopes("moe.dispatch", "moe.experts", "moe.combine", "moe.shared_expert")
    overlaps_shared = False

    def plan(self, sizes: Any, sync: HostSync) -> None:
        """Nothing of its own to read in the host sync."""

    def finish(self, state: Dispatch, pending: None) -> Dispatch:
        return state

    def dispatch(self, state: Dispatch) -> tuple[Tensor, Tensor, Any]:
        return state.wire.send(state)

    def experts(self, rows: tuple, state: Dispatch, experts: "GroupedExperts") -> Tensor:
        x_NH, gather_R, counts_L = rows
        return experts(x_NH, counts_L, gather_R)

    def back(self, y_NH: Tensor, state: Dispatch) -> Tensor:
        return state.wire.back(y_NH, state)
