"""DeepSpeed's pipeline topology from the plugin's rank layout.

DeepSpeed's ``PipelineModule`` places ranks with a ``ProcessTopology``: named axes ``pipe``,
``data`` and ``model`` (tensor slicing), laid out row-major, the *last* axis varying fastest.
From it the ``PipelineEngine`` takes which stage a rank runs, whom it sends activations to, and
the groups it reduces gradients over (``PipelineParallelGrid``: it creates handles of its own for
those rank lists). Our layout names the same dimensions in an order string read the other way
round, *first* token fastest (``tp-cp-ep-dp-pp``). So the topology's axes are the order's
attention dimensions reversed, ``tp`` -> ``model``, ``dp`` -> ``data``, ``pp`` -> ``pipe``;
``cp`` (size 1) and ``ep`` (size 1 in the attention grid: EP is carved out of TP x DP in the
expert grid only) are left out. Every order the layout accepts is expressible this way; the
DeepSpeed grid never sees the expert grid (its MoE paths read our registered expert groups).

``check_topology`` is the guard: a topology, ours or one a user built a ``PipelineModule`` with,
must give every rank the layout's stage, data-parallel index and tensor-parallel index, else a
``ConfigError`` names ``moe.parallel.order``. With it, DeepSpeed's groups and ours hold the same
ranks, and the stage DeepSpeed runs is the pipeline rank Megatron's layer offsets are computed from.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.topology import ProcessTopology

from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.schema import ROOT_KEY
from moe_plugin.groups.layout import RankLayout

# our dimension -> DeepSpeed's axis
AXES = {"pp": "pipe", "dp": "data", "tp": "model"}


def pipeline_topology(layout: RankLayout) -> ProcessTopology:
    """The ``ProcessTopology`` whose pipe/data/model axes are ``layout``'s pp/dp/tp groups."""
    grid = layout.attention_grid
    dims = [name for name in reversed(grid.names) if name in AXES]  # slowest first, as DeepSpeed reads them
    topology = ProcessTopology(axes=[AXES[d] for d in dims], dims=[grid.sizes[grid.names.index(d)] for d in dims])
    check_topology(topology, layout)
    return topology


def check_topology(topology: ProcessTopology, layout: RankLayout) -> None:
    """``topology`` must place every rank where ``layout`` does (stage, data and tensor index)."""
    order = layout.sizes.order
    if topology.world_size() != layout.world_size:
        raise ConfigError(f"{ROOT_KEY}.parallel", layout.sizes.world_size, f"the pipeline topology spans "
                          f"{topology.world_size()} ranks but the layout {layout.world_size}")
    axes = topology.get_axis_names()
    for rank in range(layout.world_size):
        coord = topology.get_coord(rank)
        mine = layout.coords(rank)
        for ours, theirs in AXES.items():
            got = getattr(coord, theirs) if theirs in axes else 0
            if got != mine[ours]:
                raise ConfigError(f"{ROOT_KEY}.parallel.order", order, f"DeepSpeed's pipeline topology (axes "
                                  f"{axes}, dims {topology.dims}, last axis fastest) puts rank {rank} at {theirs} "
                                  f"{got} but the layout at {ours} {mine[ours]}; the topology cannot express this "
                                  f"order: build the PipelineModule with moe_plugin's pipeline_topology(layout)")
