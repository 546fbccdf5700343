"""Which exchanges placement's options allow: placement's rules, added to the layer's
(``layers/exchange_rules.py``) for the ``"moe"`` block (``MoEConfig.exchange_unfit``). Shadow experts
need routes kept out of the exchange; the policies and traces read the counts round's traffic.
"""
from __future__ import annotations

from typing import Optional

from moe_plugin.layers import exchange_rules
from moe_plugin.layers.exchange_rules import overlap_unfit, shadow_unfit

__all__ = ["exchange_unfit", "exchange_variants", "overlap_unfit", "placement_unfit", "shadow_unfit"]


def placement_unfit(mode: str, *, replica_budget: int = 0, policy: str = "static",
                    trace_file: Optional[str] = None) -> Optional[str]:
    """Why the ``padded`` or ``token`` wire format cannot serve these placement options; None when it can."""
    if mode == "counts":
        return None
    padded = mode == "padded"
    why_traffic = ": the policies read the sender x expert traffic the counts round gives" if padded else ""
    checks = ((replica_budget > 0, f"needs placement.replica_budget 0 (got {replica_budget}): no shadow experts"),
              (policy != "static", f"needs placement.policy 'static' (got {policy!r}){why_traffic}"),
              (padded and trace_file is not None, "needs no placement.trace_file (the traces hold the sender x "
                                                  "expert traffic the counts round gives)"))
    return next((why for bad, why in checks if bad), None)


def exchange_unfit(mode: str, *, expert: int, expert_tensor: int, overlap_chunks: int, drop_tokens: bool,
                   replica_budget: int = 0, policy: str = "static", trace_file: Optional[str] = None) -> Optional[str]:
    """The layer's rules on these values, then placement's: why ``mode`` cannot run; None when it can."""
    return (exchange_rules.exchange_unfit(mode, expert=expert, expert_tensor=expert_tensor,
                                          overlap_chunks=overlap_chunks, drop_tokens=drop_tokens)
            or placement_unfit(mode, replica_budget=replica_budget, policy=policy, trace_file=trace_file))


def exchange_variants(*, expert: int, expert_tensor: int, num_experts: int, drop_tokens: bool,
                      replica_budget: int = 0, policy: str = "static",
                      trace_file: Optional[str] = None) -> list[tuple[str, int]]:
    """Every (``exchange``, ``overlap_chunks``) a layer of these values can run, the default
    ``("counts", 1)`` first: each wire format with 1 to the local experts' chunks, kept where
    ``overlap_unfit`` and ``exchange_unfit`` both let it through."""
    local = max(num_experts // expert, 1)
    return [(mode, chunks) for mode in ("counts", "padded", "token") for chunks in range(1, local + 1)
            if overlap_unfit(chunks, expert, expert_tensor, num_experts) is None
            and exchange_unfit(mode, expert=expert, expert_tensor=expert_tensor, overlap_chunks=chunks,
                               drop_tokens=drop_tokens, replica_budget=replica_budget, policy=policy,
                               trace_file=trace_file) is None]
