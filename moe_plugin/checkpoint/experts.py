"""Expert weights by global expert id: gather a rank's shards into full experts, cut them again.

``full_experts`` joins a rank's ETP shards (a collective over ETP) into one [H, F1] / [F, H] tensor per
global expert id; ``local_experts`` cuts full experts for any other EP x ETP layout. The same two carry
per-parameter optimizer state of the weight's shape (Adam's moments). Shape suffixes: see
``moe_plugin.layers``; the cut: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.checkpoint.shards import tp_join, tp_slice
from moe_plugin.layers.experts import GATED, GroupedExperts


@dataclass(frozen=True)
class ExpertWeight:
    """One stacked expert weight of the model: its state-dict key, module, F dimension and stride."""

    key: str
    module: GroupedExperts
    param: nn.Parameter
    f_dim: Optional[int]   # the F dimension of the stacked [L, ...] tensor (None: not split over ETP, bias2)
    f_stride: int          # pieces per shard along F (2 for swiglu's gate and up halves)

    @property
    def local_ids(self) -> list[int]:
        """Global ids of the experts this rank holds, in local-slot order (its placement)."""
        return self.module.local_ids()

    def full_shape(self, etp: int) -> list[int]:
        """[E, H, F1] / [E, F, H]: the shape of all experts of this weight, unsharded."""
        shape = list(self.param.shape)
        shape[0] = self.module.num_experts
        if self.f_dim is not None:
            shape[self.f_dim] *= etp
        return shape

    def cut(self, full: Tensor, etp_rank: int, etp: int, stacked: bool = True) -> Tensor:
        """ETP rank ``etp_rank``'s part of ``full`` (a weight not split over ETP: whole)."""
        if self.f_dim is None:
            return full
        return tp_slice(full, self.f_dim - (0 if stacked else 1), self.f_stride, etp_rank, etp)


def expert_weights(model: nn.Module) -> list[ExpertWeight]:
    """Every stacked expert weight of ``model`` (and the experts' biases), in module order."""
    out = []
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            base = f"{prefix}." if prefix else ""
            stride1 = 2 if module.activation in GATED else 1
            out.append(ExpertWeight(base + "weight1", module, module.weight1, 2, stride1))
            out.append(ExpertWeight(base + "weight2", module, module.weight2, 1, 1))
            if module.bias1 is not None:
                out.append(ExpertWeight(base + "bias1", module, module.bias1, 1, stride1))
                out.append(ExpertWeight(base + "bias2", module, module.bias2, None, 1))
    return out


def full_experts(stacked_LXY: Tensor, weight: ExpertWeight, etp_group, etp: int,
                 ids: list[int] | None = None) -> Iterator[tuple[int, Tensor]]:
    """(global id, full [H, F1] or [F, H] view) per local expert of ``stacked_LXY``, whose rows are the
    experts ``ids`` (default: the placement). Collective over ``etp_group`` when ``etp > 1``."""
    stacked_LXY = stacked_LXY.detach()
    if etp > 1 and weight.f_dim is not None:
        pieces = [torch.empty_like(stacked_LXY) for _ in range(etp)]
        dist.all_gather(pieces, stacked_LXY.contiguous(), group=etp_group)
        stacked_LXY = tp_join(pieces, weight.f_dim, weight.f_stride)
    for expert_id, full in zip(weight.local_ids if ids is None else ids, stacked_LXY.unbind(0)):
        yield expert_id, full


def local_experts(full_by_id: dict[int, Tensor], weight: ExpertWeight, etp_rank: int, etp: int,
                  ids: list[int] | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """This rank's stacked shard [L, ...] of ``weight`` cut from full experts ``ids`` (default: its placement)."""
    ids = weight.local_ids if ids is None else ids
    parts = [weight.cut(full_by_id[e], etp_rank, etp, stacked=False) for e in ids]
    out = torch.stack(parts)
    if out.shape != weight.param.shape:
        raise ValueError(f"{weight.key}: the saved experts cut to {tuple(out.shape)} on this rank (etp rank "
                         f"{etp_rank} of {etp}), but the model holds {tuple(weight.param.shape)}")
    return out.to(weight.param.dtype if dtype is None else dtype)
