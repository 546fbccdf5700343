"""Token dispatcher: permute tokens into expert order, and scatter expert outputs back.

Shape suffixes: see ``moe_plugin.layers``.

``MoELayer`` calls ``state = dispatcher.prepare(x_TH, plan, finite)``, the batch's frozen
dispatch state (``Dispatch`` here: what the dispatcher needs between dispatch and combine; the
routing plan holds routing only), then ``dispatcher.run(state, experts, shared)``, which runs the
dispatcher's ``schedule``. The one exchange (``OneExchange``)::

    x_NH, gather_R, counts_L = dispatcher.to_experts(state)
    y_RH = experts(x_NH, counts_L, gather_R)        # rows x_NH[gather_R], grouped by local expert
    out_TH = dispatcher.combine(y_RH, state)         # gate-weighted sum over each token's routes

``prepare`` holds the layer's one host sync (``host_sync.py``: the kept routes per slot, here
the experts' row counts, and the router's finite flags) and cuts the router's plan, which lists
every route with the kept ones first, to the kept ones (``RoutingPlan.kept``).

``TokenDispatcher`` is the single-process one: the expert input is the tokens themselves and
``plan.token_R``, so the experts gather the rows chunk by chunk (and again in backward)
instead of a [R, H] copy being kept for backward. Combine is ``combine.gate_combine``. Dropped
routes add nothing: their token keeps only the residual. Expert parallelism
(``ep_dispatcher.ExpertParallelDispatcher``: a wire format x a schedule x shadowing) overrides
the hooks ``prepare`` to ``combine``; permute, gate weighting and unpermute stay as they are here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch import Tensor
from torch.autograd.profiler import record_function

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.host_sync import HostSync
from moe_plugin.layers.router import FiniteCheck, RoutingPlan

if TYPE_CHECKING:
    from moe_plugin.layers.experts import GroupedExperts, SharedExpert


@dataclass(frozen=True)
class Dispatch:
    """One batch as ``TokenDispatcher`` sends it: the tokens and their checked routing (its kept routes)."""

    x_TH: Tensor
    plan: RoutingPlan
    counts_L: RowCounts      # rows per local expert, on the host and on the device
    traffic_PD: Optional[Tensor] = None   # [P, D] kept routes of each EP peer's tokens per slot (None: not learnt)


class TokenDispatcher:
    """Local dispatcher: all ``num_experts`` experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.schedule = OneExchange()

    def prepare(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck] = None) -> Dispatch:
        """The batch's state, after ``finite`` (the router's pending check of the logits). Nothing
        to exchange in a single process; one host sync (module docstring)."""
        sync = HostSync()
        kept = sync.add(plan.kept_D)
        sync.check(finite)
        sync.read()                                                     # the one host sync
        return Dispatch(x_TH, plan.kept(sum(kept.host)), RowCounts(kept.host, plan.kept_D))

    def to_experts(self, state: Dispatch) -> tuple[Tensor, Optional[Tensor], RowCounts]:
        """(x_NH, gather_R, counts_L): the experts' rows are ``x_NH[gather_R]`` (``x_NH`` itself
        when ``gather_R`` is None), grouped by local expert, ``counts_L`` rows each (on the host
        and on the device).
        Locally: the tokens and ``plan.token_R``; the local experts are the slots."""
        return state.x_TH, state.plan.token_R, state.counts_L

    def from_experts(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        """Expert outputs (rows grouped by local expert) -> rows in this rank's kept-route order."""
        return y_RH

    def combine(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        """Expert outputs [R, H] -> [T, H] in the input dtype, summed in fp32 over each token's routes."""
        plan = state.plan
        y_RH = self.from_experts(y_RH, state)
        return gate_combine(y_RH, plan.gate_R, plan.token_R, plan.route_R, plan.num_tokens, plan.k)

    def run(self, state: Dispatch, experts: "GroupedExperts", shared: Optional["SharedExpert"] = None) -> Tensor:
        """The layer's output for ``state``: experts, combine and the shared expert (if any), by the
        dispatcher's schedule."""
        return self.schedule.run(self, state, experts, shared)


class OneExchange:
    """The schedule of one exchange: every row to the experts, the experts, every row back, combine."""

    def plan(self, sizes, sync: HostSync) -> None:
        """Nothing of its own to read in the host sync."""
        return None

    def finish(self, state: Dispatch, pending: None) -> Dispatch:
        return state

    def run(self, dispatcher: TokenDispatcher, state: Dispatch, experts: "GroupedExperts",
            shared: Optional["SharedExpert"] = None) -> Tensor:
        with record_function("moe.dispatch"):
            x_NH, gather_R, counts_L = dispatcher.to_experts(state)
        with record_function("moe.experts"):
            y_NH = experts(x_NH, counts_L, gather_R)
        with record_function("moe.combine"):
            out_TH = dispatcher.combine(y_NH, state)
        if shared is not None:
            with record_function("moe.shared_expert"):
                out_TH = out_TH + shared(state.x_TH)
        return out_TH
