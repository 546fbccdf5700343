"""One tensor cut into the shards of a parallel group and joined back (TP and ETP alike).

With stride ``s`` the dimension is cut into ``s * size`` pieces and rank ``r`` holds pieces
``r, r + size, ...``: a GLU weight (stride 2) keeps a slice of its gate half and of its up half.
``cat`` and ``stack`` make a meta result's shape themselves: torch's meta ``cat`` imports TorchDynamo
on its first call (0.8-1.2 s of a conversion's start, measured 2026-11-28).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat``; on meta tensors an empty meta tensor of the result's shape (``dim`` checked as torch does)."""
    if not tensors or not all(t.is_meta for t in tensors):
        return torch.cat(list(tensors), dim=dim)
    first = tensors[0]
    d = dim % first.dim()
    for t in tensors[1:]:
        if t.dim() != first.dim() or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != d):
            raise RuntimeError(f"cat: shapes {list(first.shape)} and {list(t.shape)} differ outside dimension {dim}")
    shape = list(first.shape)
    shape[d] = sum(t.shape[d] for t in tensors)
    return torch.empty(shape, dtype=first.dtype, device="meta")


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """``torch.stack`` by way of ``cat`` (meta tensors likewise)."""
    d = dim % (tensors[0].dim() + 1)
    return cat([t.unsqueeze(d) for t in tensors], dim=d)


def tp_slice(full: Tensor, dim: int, stride: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s part of ``full`` along ``dim``: pieces ``rank::size`` of ``stride * size``."""
    if size == 1:
        return full
    pieces = stride * size
    if full.shape[dim] % pieces:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {pieces} pieces "
                         f"(parallel size {size} x stride {stride})")
    chunks = full.split(full.shape[dim] // pieces, dim=dim)
    return cat(chunks[rank::size], dim=dim)


def tp_join(shards: list[Tensor], dim: int, stride: int) -> Tensor:
    """The inverse of ``tp_slice``: the full tensor from every rank's part, in rank order."""
    size = len(shards)
    if size == 1:
        return shards[0]
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]       # rank r holds pieces r, r + size, ...
    return cat([pieces[j % size][j // size] for j in range(stride * size)], dim=dim)
