"""The dispatcher: tokens to the experts and their outputs back, as a wire format x a schedule x
shadowing (``exchange_factory.build_dispatcher`` picks them).

Shape suffixes: see ``moe_plugin.layers``.

* a wire format: how the sizes and the rows cross. ``LocalWire`` here (every expert in this
  process); under expert parallelism ``ep_dispatcher.CountsWire``, ``padded.PaddedWire``,
  ``token.TokenWire``. Its interface: ``sizes`` (add what the host sync reads), ``state`` (the
  batch's ``Dispatch`` once read), ``send`` (the experts' rows), ``back`` (their outputs, in the
  plan's kept-route order) and ``for_batch`` (the wire format of one batch);
* a schedule: ``OneExchange`` here, or ``overlap.Overlapped`` (the exchange in chunks);
* shadowing or none (``shadow.Shadowing``): the routes it holds back, its rows in the combine.

``prepare(x_TH, plan, finite)`` holds the layer's one host sync (``host_sync.py``) and cuts the
router's plan to the kept routes (``RoutingPlan.kept``; a capacity computed on the device, with
padding, is read there too): the batch's frozen ``Dispatch``. Then
``run(state, experts, shared)``; with one exchange::

    x_NH, gather_R, counts_L = state.wire.send(state)   # counts_L: on the host and on the device
    y_RH = experts(x_NH, counts_L, gather_R)            # rows x_NH[gather_R], grouped by local expert
    out_TH = dispatcher.combine(y_RH, state)            # combine.gate_combine over each token's routes

In one process the experts gather the tokens at ``plan.token_R`` chunk by chunk (again in
backward): no [R, H] copy is kept. Dropped routes add nothing: their token keeps the residual.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor
from torch.autograd.profiler import record_function

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync, HostValue
from moe_plugin.layers.router import FiniteCheck, RoutingPlan

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts, SharedExpert
    from moe_plugin.layers.shadow import Shadowing


@dataclass(frozen=True)
class Dispatch:
    """One batch as the dispatcher sends it: the tokens and their checked routing (its kept routes
    that go through the wire format); a wire format's own fields are in its subclass."""

    x_TH: Tensor
    plan: RoutingPlan
    counts_L: RowCounts      # rows per local expert, on the host and on the device
    wire: Any                # the batch's wire format (``for_batch``)
    traffic_PD: Optional[Tensor] = None   # [P, D] kept routes of each EP peer's tokens per slot (None: not learnt)


@dataclass(eq=False)
class LocalSizes:
    """What ``LocalWire`` reads in the host sync."""

    send: HostValue          # [D] kept routes per slot: all to the local experts


class LocalWire:
    """The wire format of one process: nothing crosses (module docstring)."""

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
        """The local experts are the slots: their rows are the tokens at ``plan.token_R``."""
        return state.x_TH, state.plan.token_R, state.counts_L

    def back(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        return y_RH


class Dispatcher:
    """A wire format, a schedule (default one exchange) and shadowing or none (module docstring)."""

    def __init__(self, wire: Any, schedule: Any = None, shadowing: Optional["Shadowing"] = None):
        self.wire, self.schedule, self.shadowing = wire, schedule or OneExchange(), shadowing

    def prepare(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck] = None) -> Dispatch:
        """The batch's state, after ``finite`` (the router's pending check of the logits)."""
        wire, sync = self.wire.for_batch(x_TH, plan), HostSync()
        capacity = None if plan.capacity_1 is None else sync.add(plan.capacity_1)
        held = self.shadowing.before(plan, sync) if self.shadowing is not None else None
        sizes = wire.sizes(x_TH, plan, finite, sync, None if held is None else held.shadow_D)
        pending = self.schedule.plan(sizes, sync)
        sync.read()                                                  # the one host sync; the finite verdict
        read = None if capacity is None else capacity.host[0]
        if held is None:
            return self.schedule.finish(wire.state(x_TH, plan.kept(sum(sizes.send.host), read), sizes), pending)
        plan, routes = self.shadowing.split(plan.kept(sum(sizes.send.host) + sum(held.counts.host), read), held)
        return self.schedule.finish(replace(wire.state(x_TH, plan, sizes), held=routes), pending)

    def combine(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        """Expert outputs [R, H] -> [T, H] in the input dtype, summed in fp32 over each token's routes."""
        y_RH = state.wire.back(y_RH, state)
        if self.shadowing is not None:
            return self.shadowing.combine(y_RH, state)
        plan = state.plan
        return gate_combine(y_RH, plan.gate_R, plan.token_R, plan.route_R, plan.num_tokens, plan.k)

    def run(self, state: Dispatch, experts: "GroupedExperts", shared: Optional["SharedExpert"] = None) -> Tensor:
        """The layer's output for ``state``: experts, combine and the shared expert (if any), by the
        dispatcher's schedule."""
        return self.schedule.run(self, state, experts, shared)


class OneExchange:
    """The schedule of one exchange: every row to the experts, the experts, every row back, combine."""

    def plan(self, sizes, sync: HostSync) -> None:
        """Nothing of its own to read in the host sync."""

    def finish(self, state: Dispatch, pending: None) -> Dispatch:
        return state

    def run(self, dispatcher: Dispatcher, state: Dispatch, experts: "GroupedExperts",
            shared: Optional["SharedExpert"] = None) -> Tensor:
        with record_function("moe.dispatch"):
            x_NH, gather_R, counts_L = state.wire.send(state)
        with record_function("moe.experts"):
            y_NH = experts(x_NH, counts_L, gather_R)
        with record_function("moe.combine"):
            out_TH = dispatcher.combine(y_NH, state)
        if shared is not None:
            with record_function("moe.shared_expert"):
                out_TH = out_TH + shared(state.x_TH)
        return out_TH
