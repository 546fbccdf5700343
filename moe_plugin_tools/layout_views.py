"""Text views of a RankLayout for people (``moe-plugin layout`` and ``demo``): every group of each kind,
and the groups of each rank."""
from __future__ import annotations

from moe_plugin.groups.layout import PUBLIC_KINDS, RankLayout

# The kinds a rank joins, in the order they are shown; "embedding" is the first and last stage.
REPORT_KINDS = PUBLIC_KINDS + ("embedding",)
MEANING = {
    "tp": "tensor parallel (attention, dense MLP)",
    "pp": "pipeline stages",
    "dp": "data parallel (dense gradients)",
    "ep": "expert parallel (all-to-all)",
    "etp": "expert tensor parallel",
    "edp": "expert data parallel (expert gradients)",
    "mp": "model parallel, tp x pp (DeepSpeed's mpu)",
    "embedding": "first and last pipeline stage (tied embeddings)",
}


def _ranks(group: list[int]) -> str:
    return "[" + ",".join(map(str, group)) + "]"


def group_lists(layout: RankLayout) -> str:
    """One line per group kind: the kind, its meaning and all its groups."""
    width = max(len(_meaning_label(kind)) for kind in REPORT_KINDS)
    return "\n".join(f"{_meaning_label(kind):<{width}}  " + " ".join(_ranks(g) for g in layout.groups(kind))
                     for kind in REPORT_KINDS)


def _meaning_label(kind: str) -> str:
    return f"{kind:<9} {MEANING[kind]}"


def rank_groups(layout: RankLayout) -> str:
    """A table with one row per rank and, per kind, the ranks of the group it joins."""
    header = ("rank",) + REPORT_KINDS
    rows = [header] + [(str(rank),) + tuple(_ranks(layout.group_of(kind, rank)) for kind in REPORT_KINDS)
                       for rank in range(layout.world_size)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i == 0 else cell.ljust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)
