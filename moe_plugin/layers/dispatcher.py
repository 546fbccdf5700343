"""Token dispatcher: permute tokens into expert order, and scatter expert outputs back.

Shape suffixes: see ``moe_plugin.layers``.

The interface, used by ``MoELayer`` in this order::

    plan, finite = router(x_TH)
    state = dispatcher.prepare(x_TH, plan, finite)             # finite verdict; the batch's dispatch state
    x_NH, gather_R, counts_L = dispatcher.to_experts(state)
    y_RH = experts(x_NH, counts_L, gather_R)                  # rows x_NH[gather_R], grouped by local expert
    out_TH = dispatcher.combine(y_RH, state)                   # gate-weighted sum over each token's routes

``prepare`` returns the dispatcher's own frozen state for the batch (``Dispatch`` here): what it
needs between dispatch and combine. The routing plan holds routing only.

``prepare`` holds the layer's one host sync: a single transfer brings what the forward needs on
the host (here the kept routes per slot, which are the experts' row counts, and the router's
finite flags); the router's plan lists every route, the kept ones first, and is cut to the kept
ones with the count read there (``RoutingPlan.kept``).

``TokenDispatcher`` is the single-process one: the expert input is the tokens themselves and
``plan.token_R``, so the experts gather the rows chunk by chunk (and again in backward)
instead of a [R, H] copy being kept for backward. Combine is ``combine.gate_combine``: a
gather per token over its routes, summed in fp32, with a gather backward; deterministic, no
[K*T, H] buffer. Dropped routes add nothing: their token keeps only the residual.

Expert parallelism slots in by subclassing and overriding the hooks
(``ep_dispatcher.ExpertParallelDispatcher``):

* ``prepare``: exchange the per-expert counts across the EP (and ETP) group, read them and the
  router's finite verdict in the one host sync before anything leaves the rank, and return an
  ``Exchange`` (a ``Dispatch`` with the splits and the re-sort permutation);
* ``to_experts``: the uneven all-to-all of the expert-sorted rows; returns the received rows,
  the local re-sort as a row index the experts gather by, and the per-local-expert counts;
* ``from_experts``: the inverse re-sort and the reverse all-to-all;
* ``traffic``: the sender x slot matrix of the counts exchange.

Shadow experts (``shadow.ShadowingDispatcher``) derive from that, behind the same interface.
Everything else (permute, gate weighting, unpermute) stays as it is here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.ffn_autograd import RowCounts
from moe_plugin.layers.router import FiniteCheck, RoutingPlan


@dataclass(frozen=True)
class Dispatch:
    """One batch as ``TokenDispatcher`` sends it: the tokens and their checked routing (its kept routes)."""

    x_TH: Tensor
    plan: RoutingPlan
    counts_L: RowCounts      # rows per local expert, on the host and on the device


class TokenDispatcher:
    """Local dispatcher: all ``num_experts`` experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    # -- hooks an expert-parallel dispatcher overrides ---------------------------------------
    def prepare(self, x_TH: Tensor, plan: RoutingPlan, finite: Optional[FiniteCheck] = None) -> Dispatch:
        """The batch's state, after ``finite`` (the router's pending check of the logits). Nothing
        to exchange in a single process; one host sync (module docstring)."""
        D = plan.kept_D.numel()
        flags = finite.flags() if finite is not None else plan.kept_D.new_zeros(0)
        host = torch.cat([plan.kept_D, flags.to(plan.kept_D.dtype)]).tolist()   # the one host sync
        if finite is not None:
            finite.verdict(host[D:], finite.group)
        return Dispatch(x_TH, plan.kept(sum(host[:D])), RowCounts(host[:D], plan.kept_D))

    def to_experts(self, state: Dispatch) -> tuple[Tensor, Optional[Tensor], RowCounts]:
        """(x_NH, gather_R, counts_L): the experts' rows are ``x_NH[gather_R]`` (``x_NH`` itself
        when ``gather_R`` is None), grouped by local expert, ``counts_L`` rows each (on the host
        and on the device).
        Locally: the tokens and ``plan.token_R``; the local experts are the slots."""
        return state.x_TH, state.plan.token_R, state.counts_L

    def from_experts(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        """Expert outputs (rows grouped by local expert) -> rows in this rank's kept-route order."""
        return y_RH

    def traffic(self, state: Dispatch) -> Optional[Tensor]:
        """[P, D] kept routes of each EP peer's tokens per slot; None without an exchange."""
        return None

    def combine(self, y_RH: Tensor, state: Dispatch) -> Tensor:
        """Expert outputs [R, H] -> [T, H] in the input dtype, summed in fp32 over each token's routes."""
        plan = state.plan
        y_RH = self.from_experts(y_RH, state)
        return gate_combine(y_RH, plan.gate_R, plan.token_R, plan.route_R, plan.num_tokens, plan.k)
