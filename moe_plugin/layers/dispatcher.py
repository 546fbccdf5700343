"""The dispatcher: a wire format (``wire.Wire``) x a schedule (``schedule.Schedule``) x shadowing or
none (``shadow.Shadowing``), built by ``exchange_factory``. ``MoELayer.forward`` calls ``prepare``
(the one host sync: the batch's frozen ``Dispatch``), ``dispatch``, ``experts`` and ``combine``; each
runs its step by the schedule. Shape suffixes: see ``moe_plugin.layers``; the path: docs/moe_layer.md.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor
from torch.autograd.profiler import record_function

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.host_sync import HostSync
from moe_plugin.layers.router import FiniteCheck, RoutingPlan
from moe_plugin.layers.schedule import OneExchange, Schedule
from moe_plugin.layers.wire import Dispatch, Wire

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts
    from moe_plugin.layers.shadow import Shadowing


class Dispatcher:
    """A wire format, a schedule (default one exchange) and shadowing or none (module docstring)."""

    def __init__(self, wire: Wire, schedule: Optional[Schedule] = None, shadowing: Optional["Shadowing"] = None):
        self.wire, self.schedule, self.shadowing = wire, schedule or OneExchange(), shadowing

    def prepare(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck] = None) -> Dispatch:
        """The batch's state, after ``finite`` (the router's pending check of the logits) and the
        one host sync; the router's plan cut to the kept routes (``RoutingPlan.kept``)."""
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

    def dispatch(self, state: Dispatch) -> Any:
        """The rows to the experts, by the schedule (the overlapped one starts them)."""
        with record_function(self.schedule.scopes.dispatch):
            return self.schedule.dispatch(state)

    def experts(self, rows: Any, state: Dispatch, experts: "GroupedExperts") -> Any:
        """The local experts on the rows ``dispatch`` gave."""
        with record_function(self.schedule.scopes.experts):
            return self.schedule.experts(rows, state, experts)

    def combine(self, y: Any, state: Dispatch) -> Tensor:
        """The experts' outputs back and summed per token, [T, H] in the input dtype (fp32 sums);
        with shadowing, its routes' rows computed here join them."""
        with record_function(self.schedule.scopes.combine):
            y_RH = self.schedule.back(y, state)
            if self.shadowing is not None:
                return self.shadowing.combine(y_RH, state)
            plan = state.plan
            return gate_combine(y_RH, plan.gate_R, plan.token_R, plan.route_R, plan.num_tokens, plan.k)
