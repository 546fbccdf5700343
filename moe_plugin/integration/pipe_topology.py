"""DeepSpeed's pipeline topology from the plugin's rank layout: tp/dp/pp as DeepSpeed's ``model``/``data``/``pipe``
axes; ``check_topology`` refuses, naming ``moe.parallel.order``, a topology that places a rank elsewhere.
Design: docs/design/pipeline_deepspeed.md.
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
