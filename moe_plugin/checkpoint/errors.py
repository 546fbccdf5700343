"""The one error a checkpoint raises; ``agree`` makes one rank's failure the same ``CheckpointError``
on every rank, so no rank goes on to load while another stops.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the running model; the message says what differs."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def agree(fn: Callable[[], Any], group: Optional[dist.ProcessGroup] = None) -> Any:
    """``fn()`` on every rank of ``group`` (default: the world); a ``CheckpointError`` on any is raised on all."""
    error, value = None, None
    try:
        value = fn()
    except CheckpointError as exc:
        error = str(exc)
    except (OSError, RuntimeError, KeyError, EOFError) as exc:  # an unreadable file on this rank only
        error = f"{type(exc).__name__}: {exc}"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(message if rank == dist.get_rank(group) or error == message else f"rank {rank}: {message}")
    return value
