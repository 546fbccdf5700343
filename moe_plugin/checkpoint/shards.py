"""One tensor cut into the shards of a parallel group and joined back (TP and ETP alike).

With stride ``s`` the dimension is cut into ``s * size`` equal pieces and rank ``r`` holds pieces
``r, r + size, ...`` in order: a GLU weight (stride 2) keeps a slice of its gate half and of its
up half, as Megatron's own initialisation and ``layers.experts.ffn_shard`` split it.
"""
from __future__ import annotations

import torch
from torch import Tensor


def tp_slice(full: Tensor, dim: int, stride: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s part of ``full`` along ``dim``: pieces ``rank::size`` of ``stride * size``."""
    if size == 1:
        return full
    pieces = stride * size
    if full.shape[dim] % pieces:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {pieces} pieces "
                         f"(parallel size {size} x stride {stride})")
    chunks = full.split(full.shape[dim] // pieces, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def tp_join(shards: list[Tensor], dim: int, stride: int) -> Tensor:
    """The inverse of ``tp_slice``: the full tensor from every rank's part, in rank order."""
    size = len(shards)
    if size == 1:
        return shards[0]
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]       # rank r holds pieces r, r + size, ...
    return torch.cat([pieces[j % size][j // size] for j in range(stride * size)], dim=dim)
