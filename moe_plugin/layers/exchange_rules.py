"""Which exchange options a layer can run together: the rules of its own values (layout, shadowed
experts, what reads the traffic), once. Plain values in, a reason out (None: it combines); no
torch. Placement's options have theirs in ``placement/rules.py``.
"""
from __future__ import annotations

from typing import Optional


def exchange_unfit(mode: str, *, expert: int, expert_tensor: int, overlap_chunks: int, drop_tokens: bool,
                   shadowed: int = 0, traffic: Optional[str] = None) -> Optional[str]:
    """Why the ``padded`` or ``token`` wire format cannot run with these options; None when it can
    (``counts`` always can). Both need one exchange of unshadowed experts under EP without ETP;
    padded also a capacity and no reader (``traffic``) of the traffic only the counts round gives."""
    if mode == "counts":
        return None
    padded = mode == "padded"
    checks = ((padded and not drop_tokens, "needs drop_tokens true (a capacity bounds the rows)"),
              (expert == 1, "needs parallel.expert > 1"),
              (expert_tensor > 1, f"needs parallel.expert_tensor 1 (got {expert_tensor})"),
              (overlap_chunks > 1, f"needs overlap_chunks 1 (got {overlap_chunks})"),
              (shadowed > 0, f"needs no shadowed experts (got {shadowed})"),
              (padded and traffic is not None, f"needs no reader of the sender x expert traffic (got {traffic})"))
    return next((why for bad, why in checks if bad), None)


def shadow_unfit(expert: int, expert_tensor: int) -> Optional[str]:
    """Why experts cannot be shadowed under this layout; None when they can."""
    if expert > 1 and expert_tensor == 1:
        return None
    return ("shadow experts need expert parallelism without expert tensor parallelism: they need parallel.expert "
            f"> 1 and parallel.expert_tensor 1 (got expert {expert}, expert_tensor {expert_tensor})")


def overlap_unfit(overlap_chunks: int, expert: int, expert_tensor: int, num_experts: int) -> Optional[str]:
    """Why the exchange cannot run in ``overlap_chunks`` chunks; None when it can."""
    if overlap_chunks > 1 and expert == 1:
        return ("there is no expert-parallel exchange to overlap (parallel.expert 1); set parallel.expert > 1 or "
                "overlap_chunks 1")
    local = num_experts // expert
    if overlap_chunks > 1 and (expert_tensor > 1 or overlap_chunks > local):
        return (f"must be 1 with parallel.expert_tensor > 1 (got {expert_tensor}) and at most the local experts "
                f"({local}: num_experts {num_experts} / parallel.expert {expert})")
    return None
