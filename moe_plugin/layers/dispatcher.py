"""Token dispatcher: permute tokens into expert order, and scatter expert outputs back.

Shape suffixes: T tokens, H hidden, E experts, L local experts, K choices per token,
R kept routes (rows in expert order).

The interface, used by ``MoELayer`` in this order::

    plan = dispatcher.prepare(plan)                            # finite verdict; per-batch exchange layout (EP: counts)
    x_NH, gather_R, counts_L = dispatcher.to_experts(x_TH, plan)
    y_RH = experts(x_NH, counts_L, gather_R)                  # rows x_NH[gather_R], grouped by local expert
    out_TH = dispatcher.combine(y_RH, plan)                    # gate-weighted sum over each token's routes

``dispatch(x_TH, plan) -> (x_RH, counts_L)`` is the same with the rows gathered into one tensor.

``TokenDispatcher`` is the single-process one: the expert input is the tokens themselves and
``plan.token_R``, so the experts gather the rows chunk by chunk (and again in backward)
instead of a [R, H] copy being kept for backward. Combine is ``combine.gate_combine``: a
gather per token over its routes, summed in fp32, with a gather backward; deterministic, no
[K*T, H] buffer. Dropped routes add nothing: their token keeps only the residual.

Expert parallelism slots in by subclassing and overriding the three hooks
(``ep_dispatcher.ExpertParallelDispatcher``):

* ``prepare``: read the router's finite verdict (``plan.finite``) before anything leaves the
  rank, exchange the per-expert counts across the EP (and ETP) group and return
  ``dataclasses.replace(plan, exchange=...)`` with the splits and the re-sort permutation;
* ``to_experts``: the uneven all-to-all of the expert-sorted rows; returns the received rows,
  the local re-sort as a row index the experts gather by, and the per-local-expert counts;
* ``from_experts``: the inverse re-sort and the reverse all-to-all.

Everything else (permute, gate weighting, unpermute) stays as it is here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch import Tensor

from moe_plugin.layers.combine import gate_combine
from moe_plugin.layers.router import RoutingPlan


class TokenDispatcher:
    """Local dispatcher: all ``num_experts`` experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    # -- hooks an expert-parallel dispatcher overrides ---------------------------------------
    def prepare(self, plan: RoutingPlan, shadow_S: Optional[Tensor] = None) -> RoutingPlan:
        """Per-batch exchange layout; nothing to exchange in a single process. ``shadow_S``
        (bool [S], slots whose routes this rank computes itself, ``shadow.py``) needs EP."""
        if shadow_S is not None:
            raise ValueError("shadow experts need expert parallelism")
        if plan.finite is not None:
            plan.finite.check()
            plan = dataclasses.replace(plan, finite=None)
        return plan

    def to_experts(self, x_TH: Tensor, plan: RoutingPlan) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """[T, H] -> (x_NH, gather_R, counts_L): the experts' rows are ``x_NH[gather_R]`` (``x_NH``
        itself when ``gather_R`` is None), grouped by local expert, ``counts_L`` rows each.
        Locally: the tokens and ``plan.token_R``; the local experts are the slots."""
        return x_TH, plan.token_R, plan.kept_S

    def from_experts(self, y_RH: Tensor, plan: RoutingPlan) -> Tensor:
        """Expert outputs (rows grouped by local expert) -> rows in this rank's kept-route order."""
        return y_RH

    # -- conveniences ------------------------------------------------------------------------
    def dispatch(self, x_TH: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
        """[T, H] -> (rows of kept routes grouped by local expert [R, H], counts per local expert)."""
        x_NH, gather_R, counts_L = self.to_experts(x_TH, plan)
        return (x_NH if gather_R is None else x_NH.index_select(0, gather_R)), counts_L

    def combine(self, y_RH: Tensor, plan: RoutingPlan) -> Tensor:
        """Expert outputs [R, H] -> [T, H] in the input dtype, summed in fp32 over each token's routes."""
        y_RH = self.from_experts(y_RH, plan)
        return gate_combine(y_RH, plan.gate_R, plan.token_R, plan.route_R, plan.num_tokens, plan.k)
