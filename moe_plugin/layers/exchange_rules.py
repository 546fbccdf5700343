"""Which exchange options combine: the rules, once (``exchange_factory`` and the config ask them).

Plain values in, a reason out (None: it combines); no torch. The config's validation asks them
with the ``"moe"`` block's values (``MoEConfig.exchange_unfit``), the factory with what the layer
knows at run time too: the experts shadowed now and whether a load tracker reads the sender x
expert traffic.
"""
from __future__ import annotations

from typing import Optional


def exchange_unfit(mode: str, *, expert: int, expert_tensor: int, overlap_chunks: int, drop_tokens: bool,
                   replica_budget: int = 0, policy: str = "static", trace_file: Optional[str] = None,
                   shadowed: int = 0, traffic: Optional[str] = None) -> Optional[str]:
    """Why the ``padded`` (``padded.py``) or ``token`` (``token.py``) wire format cannot run with
    these options; None when it can (``counts`` always can). Both need one exchange per layer of
    unreplicated experts under EP without ETP; padded also a capacity and no consumer of the sender x
    expert traffic that only the counts round gives. ``shadowed``: experts shadowed at run time;
    ``traffic``: what reads the traffic at run time (a load tracker)."""
    if mode == "counts":
        return None
    padded = mode == "padded"
    why_traffic = ": the policies read the sender x expert traffic the counts round gives" if padded else ""
    checks = ((padded and not drop_tokens, "needs drop_tokens true (a capacity bounds the rows)"),
              (expert == 1, "needs parallel.expert > 1"),
              (expert_tensor > 1, f"needs parallel.expert_tensor 1 (got {expert_tensor})"),
              (overlap_chunks > 1, f"needs overlap_chunks 1 (got {overlap_chunks})"),
              (replica_budget > 0, f"needs placement.replica_budget 0 (got {replica_budget}): no shadow experts"),
              (shadowed > 0, f"needs no shadowed experts (got {shadowed})"),
              (policy != "static", f"needs placement.policy 'static' (got {policy!r}){why_traffic}"),
              (padded and trace_file is not None, "needs no placement.trace_file (the traces hold the sender x "
                                                  "expert traffic the counts round gives)"),
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


def exchange_variants(*, expert: int, expert_tensor: int, num_experts: int, drop_tokens: bool,
                      replica_budget: int = 0, policy: str = "static",
                      trace_file: Optional[str] = None) -> list[tuple[str, int]]:
    """Every (``exchange``, ``overlap_chunks``) a layer of these values can run, the default
    ``("counts", 1)`` first: each wire format with 1 to the local experts' chunks
    (``num_experts // expert``), kept where ``overlap_unfit`` and ``exchange_unfit`` both let it
    through. The rules decide; this only asks them (the tests' exchange twins are these)."""
    local = max(num_experts // expert, 1)
    return [(mode, chunks) for mode in ("counts", "padded", "token") for chunks in range(1, local + 1)
            if overlap_unfit(chunks, expert, expert_tensor, num_experts) is None
            and exchange_unfit(mode, expert=expert, expert_tensor=expert_tensor, overlap_chunks=chunks,
                               drop_tokens=drop_tokens, replica_budget=replica_budget, policy=policy,
                               trace_file=trace_file) is None]
