"""Rank layout -> real process groups, created once per job.

Every rank creates every rank list in the same order, and a list two kinds share once (a communicator
costs GPU memory). The few groups Megatron-Core's registry also holds (``MEGATRON_KINDS``) are created
too, so that registering never creates groups. Design: docs/design/groups_layout.md.
"""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch.distributed as dist

from moe_plugin.groups.layout import GROUP_KINDS, RankLayout
from moe_plugin.groups.process_groups import ProcessGroups

logger = logging.getLogger(__name__)

# Groups that are no layout kind but that Megatron-Core's parallel_state holds: context
# parallel (size 1 here: one rank), expert TP x EP x PP, and the position-embedding group
# (the first pipeline stage alone).
MEGATRON_KINDS = ("cp", "etp_ep_pp", "pos_embedding")


def rank_lists(layout: RankLayout) -> dict[str, list[list[int]]]:
    """Every group the builder creates, by kind, in creation order."""
    lists = {kind: layout.groups(kind) for kind in (*GROUP_KINDS, "embedding")}
    lists["cp"] = [[rank] for rank in range(layout.world_size)]
    lists["etp_ep_pp"] = layout.expert_grid.groups(("tp", "ep", "pp"))
    lists["pos_embedding"] = [[ranks[0]] for ranks in layout.groups("pp")]
    return lists


def build_process_groups(layout: RankLayout, backend: Optional[str] = None,
                         timeout: Optional[datetime.timedelta] = None) -> ProcessGroups:
    """Create every group of ``layout`` on every rank (collective); return this rank's ``ProcessGroups``.
    ``backend`` defaults to DeepSpeed's accelerator's (gloo on CPU, nccl on GPU); ``timeout`` to torch's."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_process_groups needs torch.distributed to be initialised first "
                           "(deepspeed.init_distributed() or torch.distributed.init_process_group())")
    world_size = dist.get_world_size()
    if world_size != layout.world_size:
        raise ValueError(f"the rank layout is for a world of {layout.world_size} ranks but torch.distributed "
                         f"runs {world_size}; build the layout with world_size={world_size}")
    if backend is None:
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().communication_backend_name()
    rank = dist.get_rank()

    lists_by_kind = rank_lists(layout)
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    handles: dict[str, dist.ProcessGroup] = {}
    for kind, lists in lists_by_kind.items():
        for ranks in lists:
            key = tuple(ranks)
            if key not in created:
                created[key] = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=kind)
            if rank in ranks:
                handles[kind] = created[key]

    if rank == 0:
        logger.info("process groups (%s): %d rank lists, %d distinct groups created\n%s",
                    backend, sum(map(len, lists_by_kind.values())), len(created), layout.table())
    return ProcessGroups(layout=layout, rank=rank, backend=backend, handles=handles)


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Destroy this rank's handles (each once; not the default group), once unregistered."""
    seen: set[int] = set()
    for handle in groups.handles.values():
        if id(handle) not in seen:
            seen.add(id(handle))
            dist.destroy_process_group(handle)
