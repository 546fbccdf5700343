"""Where an expert's optimizer state lies in DeepSpeed's ZeRO-1/2 flat partitions, as pieces to move.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` (``runtime/zero/stage_1_and_2.py``) flattens each
param group's parameters into one buffer ``bit16_groups_flat[i]`` (parameters in group order,
each padded to 16 bytes, the whole padded to a multiple of the group's data-parallel size) and
makes every parameter's ``.data`` a view into it. The buffer is cut into ``dp`` equal partitions
of ``partition_size[i]`` elements; data-parallel rank ``j`` of the group's process group
(``real_dp_process_group[i]``: for an expert group, our expert-data-parallel group) owns
partition ``j``: the fp32 master copy ``single_partition_of_fp32_groups[i]`` and the inner
optimizer's state of that tensor (Adam's ``exp_avg``, ``exp_avg_sq``: same shape; ``step``:
a scalar, equal for every element, so it stays).

An expert param group holds the same parameters with the same shapes on every EP rank, so an
element's flat offset ``f`` is the same on every EP rank and lives in partition ``f // ps``. The
shard of expert ``e`` of weight ``w`` (its local slot ``l`` of L) covers flat
``[off_w + l * n, off_w + (l + 1) * n)``, ``n`` the elements of one expert's shard. Moving the
expert from slot ``(p, l)`` to slot ``(p', l')`` moves element ``x < n`` from partition
``(off_w + l * n + x) // ps`` on EP rank p to partition ``(off_w + l' * n + x) // ps`` on EP
rank p': ``[0, n)`` is cut at the partition boundaries of both sides, and each run goes from the
(EP p, EDP j) rank to the (EP p', EDP j') rank with the same ETP and pipeline coordinates. The
parameters' offsets are read from their storage (``data_ptr`` minus the flat buffer's), so
DeepSpeed's per-parameter padding and round-robin order need no modelling.

Gradients are not moved: under ZeRO-1/2 migration happens at a step boundary, where DeepSpeed
holds no expert gradient (``migration.check_step_boundary``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.placement.exchange import Piece, Pieces

# (expert id, source slot, destination slot) of one layer
Move = tuple[int, int, int]
# (EP rank, EDP rank) -> global rank with this rank's ETP and pipeline coordinates
RankOf = Callable[[int, int], int]


def is_zero_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer with the attributes read here."""
    return all(hasattr(optimizer, a) for a in ("bit16_groups", "bit16_groups_flat", "partition_size",
                                               "single_partition_of_fp32_groups", "real_dp_process_group"))


def expert_group_indices(optimizer) -> list[int]:
    """Indices of the param groups that hold expert parameters (``'moe': True``)."""
    return [i for i, g in enumerate(optimizer.optimizer.param_groups) if g.get("moe", False)]


def partition_state(optimizer, i: int) -> list[Tensor]:
    """The fp32 master partition of group ``i`` and every optimizer state tensor of its size, by
    state name (the same list on every rank that has stepped as often)."""
    fp32 = optimizer.single_partition_of_fp32_groups[i]
    state = optimizer.optimizer.state.get(fp32, {})
    return [fp32.data] + [state[k] for k in sorted(state)
                          if isinstance(state[k], Tensor) and state[k].numel() == fp32.numel() and state[k].dim() > 0]


def add_partition_moves(pieces: Pieces, optimizer, moves_of: Callable[[nn.Parameter], tuple[int, list[Move]]],
                        rank_of: RankOf, me: int) -> None:
    """Append to ``pieces`` the sends and receives of this rank that move the ZeRO partitions of
    every expert param group. ``moves_of(param)``: (L, the moves of the layer that owns it)."""
    for i in expert_group_indices(optimizer):
        flat = optimizer.bit16_groups_flat[i]
        ps = int(optimizer.partition_size[i])
        ids = [pieces.add_tensor(t) for t in partition_state(optimizer, i)]
        for param in optimizer.bit16_groups[i]:
            offset = _flat_offset(param, flat)
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


def my_partition(optimizer, i: int) -> int:
    return dist.get_rank(group=optimizer.real_dp_process_group[i])


def _flat_offset(param: nn.Parameter, flat: Tensor) -> int:
    """Element offset of ``param``'s storage inside DeepSpeed's flat buffer ``flat``."""
    delta = param.data.data_ptr() - flat.data_ptr()
    size = flat.element_size()
    if delta % size or not 0 <= delta // size <= flat.numel() - param.numel() or not param.data.is_contiguous():
        raise RuntimeError(f"an expert parameter of shape {tuple(param.shape)} is not a contiguous view into "
                           "DeepSpeed's flat ZeRO buffer of its param group; this DeepSpeed version lays out "
                           "ZeRO-1/2 parameters in a way migration does not know")
    return delta // size


def _runs(src_off: int, dst_off: int, n: int, ps: int) -> Iterable[tuple[int, int]]:
    """``[0, n)`` cut where ``src_off + x`` or ``dst_off + x`` crosses a multiple of ``ps``."""
    cuts = {0, n}
    for off in (src_off, dst_off):
        first = (off // ps + 1) * ps - off
        cuts.update(range(first, n, ps))
    points = sorted(cuts)
    return zip(points[:-1], points[1:])
