"""The one explicit groups object that layers receive through their constructor.

Layers read ``groups.ep``, ``groups.tp`` ..., ``None`` where the size is 1, so a single-process run and
a size-1 dimension take the same code path; the real handles of every kind stay in ``handles``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from moe_plugin.groups.layout import RankLayout


@dataclass(frozen=True)
class ProcessGroups:
    layout: RankLayout
    rank: int
    backend: str
    handles: dict[str, dist.ProcessGroup] = field(repr=False)

    # -- per kind ------------------------------------------------------------------------
    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's ``kind`` group."""
        return self.layout.group_of(kind, self.rank)

    def size(self, kind: str) -> int:
        return len(self.ranks(kind))

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its ``kind`` group."""
        return self.ranks(kind).index(self.rank)

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """The group of ``kind``, or ``None`` where its size is 1."""
        return self.handles[kind] if self.size(kind) > 1 else None

    # -- what layers read: the group of each kind, None where its size is 1 ----------------
    tp = property(lambda self: self.group("tp"))
    pp = property(lambda self: self.group("pp"))
    dp = property(lambda self: self.group("dp"))
    ep = property(lambda self: self.group("ep"))
    etp = property(lambda self: self.group("etp"))
    edp = property(lambda self: self.group("edp"))
    mp = property(lambda self: self.group("mp"))

    @property
    def expert_group_name(self) -> str:
        """DeepSpeed's registry key of the expert groups, also each expert parameter's ``group_name``."""
        return f"ep_size_{self.layout.sizes.ep}"
