"""One batched point-to-point exchange of tensor pieces, the transport under ``migration.py``: every
rank lists its sends and receives from the same enumeration, and ``exchange`` moves them all in one
uneven all-to-all per dtype. How: docs/design/placement_migration.md.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """``tensors[tensor][offset:offset + length]`` goes to (or comes from) global rank ``peer``."""

    peer: int
    tensor: int
    offset: int
    length: int


@dataclass
class Pieces:
    """The 1-D tensor views a rank moves pieces of, and its send and receive lists."""

    tensors: list[Tensor] = field(default_factory=list)
    sends: list[Piece] = field(default_factory=list)
    recvs: list[Piece] = field(default_factory=list)

    def add_tensor(self, t: Tensor) -> int:
        """Register a tensor (viewed flat, in place); returns its index for pieces."""
        if not t.is_contiguous():
            raise ValueError(f"migration moves pieces of contiguous tensors only; got one of shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")
        self.tensors.append(t.view(-1))
        return len(self.tensors) - 1

    def sent_bytes(self, me: int) -> int:
        """Bytes this rank sends to other ranks (pieces it keeps are not counted)."""
        return sum(p.length * self.tensors[p.tensor].element_size() for p in self.sends if p.peer != me)


def exchange(pieces: Pieces, world_size: int, dtypes: list[torch.dtype]) -> None:
    """Move every piece: one ``all_to_all_single`` per dtype of ``dtypes`` over the default group
    (collective; ``dtypes`` the same list on every rank, a rank with nothing to send joins)."""
    for dtype in dtypes:
        sends = [p for p in pieces.sends if pieces.tensors[p.tensor].dtype == dtype]
        recvs = [p for p in pieces.recvs if pieces.tensors[p.tensor].dtype == dtype]
        _exchange_one_dtype(pieces.tensors, sends, recvs, world_size, dtype)


def accelerator_device() -> torch.device:
    """Where a rank with no tensor to move puts its empty buffers: the accelerator's current device."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def _by_peer(items: list[Piece], world_size: int) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = defaultdict(list)
    for p in items:  # stable: the list order within each peer
        if not 0 <= p.peer < world_size:
            raise ValueError(f"migration piece addressed to rank {p.peer}, outside the world of {world_size}")
        out[p.peer].append(p)
    return out


def _exchange_one_dtype(tensors: list[Tensor], sends: list[Piece], recvs: list[Piece], world_size: int,
                        dtype: torch.dtype) -> None:
    device = tensors[0].device if tensors else accelerator_device()
    send_by, recv_by = _by_peer(sends, world_size), _by_peer(recvs, world_size)
    in_splits = [sum(p.length for p in send_by.get(r, [])) for r in range(world_size)]
    out_splits = [sum(p.length for p in recv_by.get(r, [])) for r in range(world_size)]
    views = [tensors[p.tensor].narrow(0, p.offset, p.length) for r in range(world_size) for p in send_by.get(r, [])]
    send_X = torch.cat(views) if views else torch.empty(0, dtype=dtype, device=device)
    recv_X = torch.empty(sum(out_splits), dtype=dtype, device=device)
    if world_size > 1:
        dist.all_to_all_single(recv_X, send_X, out_splits, in_splits)
    else:
        recv_X.copy_(send_X)
    pos = 0
    for r in range(world_size):
        for p in recv_by.get(r, []):
            tensors[p.tensor].narrow(0, p.offset, p.length).copy_(recv_X.narrow(0, pos, p.length))
            pos += p.length
