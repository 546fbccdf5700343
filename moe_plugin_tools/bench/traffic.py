"""Bytes one rank sends to other ranks in one expert-parallel all-to-all (dispatch; combine is the same).

Static placement: EP rank p hosts experts ``[p * L, (p + 1) * L)``, ``L = E / ep``.

* ours: only the routed rows travel (uneven all-to-all, counts exchanged first), so a rank sends
  the kept routes of its tokens whose expert lives on another rank: rows x H x dtype size.
* DeepSpeed: every rank sends its whole ``[E, C, H]`` buffer in an even all-to-all, padding
  included; ``1/ep`` of it stays on the rank, the rest, ``E * C * (ep - 1) / ep`` slots, crosses.

Backward moves the same bytes again in the opposite direction. Rows a rank keeps (its own experts)
are never counted.
"""
from __future__ import annotations

import torch
from torch import Tensor


def ours_rows_sent(kept_E: Tensor, ep_size: int, ep_rank: int) -> int:
    """Kept routes of this rank's tokens (``kept_E`` per global expert) bound for other EP ranks."""
    per_rank = kept_E.reshape(ep_size, -1).sum(1)
    return int(per_rank.sum() - per_rank[ep_rank])


def ours_bytes_sent(kept_E: Tensor, ep_size: int, ep_rank: int, hidden: int, element_size: int) -> int:
    return ours_rows_sent(kept_E, ep_size, ep_rank) * hidden * element_size


def deepspeed_bytes_sent(num_experts: int, capacity: int, ep_size: int, hidden: int, element_size: int) -> int:
    """The slots of DeepSpeed's ``[E, C, H]`` dispatch buffer that leave the rank, in bytes."""
    return num_experts * capacity * (ep_size - 1) // ep_size * hidden * element_size


def token_rank_rows_sent(token_R: Tensor, slot_R: Tensor, num_local: int, ep_size: int, ep_rank: int) -> int:
    """Distinct (token, EP rank) pairs among this rank's kept routes (``token_R``, ``slot_R``) bound
    for other EP ranks: the rows a dispatch that sent each token once per destination rank (and
    summed its experts' outputs there) would move. Group-limited routing bounds these, not the routes."""
    rank_R = torch.div(slot_R, num_local, rounding_mode="floor")
    remote_R = rank_R != ep_rank
    return int(torch.unique(token_R[remote_R] * ep_size + rank_R[remote_R]).numel())
