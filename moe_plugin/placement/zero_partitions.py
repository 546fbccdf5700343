"""Where an expert's optimizer state lies in DeepSpeed's ZeRO-1/2 flat partitions, as pieces to
move: an expert's shard is one flat range, cut at the partition boundaries of both sides. Gradients
are not moved (migration runs at a step boundary). docs/design/placement_migration.md.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from moe_plugin.compat.deepspeed_zero import expert_group_indices, flat_offset, group_params, partition_size, \
    partition_state
from moe_plugin.placement.pieces import Piece, Pieces

# (expert id, source slot, destination slot) of one layer
Move = tuple[int, int, int]
# (EP rank, EDP rank) -> global rank with this rank's ETP and pipeline coordinates
RankOf = Callable[[int, int], int]


def add_partition_moves(pieces: Pieces, optimizer, moves_of: Callable[[nn.Parameter], tuple[int, list[Move]]],
                        rank_of: RankOf, me: int) -> None:
    """Append this rank's sends and receives of every expert param group's ZeRO partitions to ``pieces``."""
    for i in expert_group_indices(optimizer):
        ps = partition_size(optimizer, i)
        ids = [pieces.add_tensor(t) for t in partition_state(optimizer, i)]
        for param in group_params(optimizer, i):
            offset = flat_offset(optimizer, i, param)
            num_local, moves = moves_of(param)
            n = param.numel() // num_local
            for _expert, src, dst in moves:
                src_off, dst_off = offset + (src % num_local) * n, offset + (dst % num_local) * n
                for x0, x1 in _runs(src_off, dst_off, n, ps):
                    j_src, j_dst = (src_off + x0) // ps, (dst_off + x0) // ps
                    src_rank = rank_of(src // num_local, j_src)
                    dst_rank = rank_of(dst // num_local, j_dst)
                    if me == src_rank:
                        pieces.sends += [Piece(dst_rank, t, src_off + x0 - j_src * ps, x1 - x0) for t in ids]
                    if me == dst_rank:
                        pieces.recvs += [Piece(src_rank, t, dst_off + x0 - j_dst * ps, x1 - x0) for t in ids]


def _runs(src_off: int, dst_off: int, n: int, ps: int) -> Iterable[tuple[int, int]]:
    """``[0, n)`` cut where ``src_off + x`` or ``dst_off + x`` crosses a multiple of ``ps``."""
    cuts = {0, n}
    for off in (src_off, dst_off):
        first = (off // ps + 1) * ps - off
        cuts.update(range(first, n, ps))
    points = sorted(cuts)
    return zip(points[:-1], points[1:])
