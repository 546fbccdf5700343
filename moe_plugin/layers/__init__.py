"""MoE layers: router, token dispatchers, grouped experts, the MoE layer and its reference oracle."""
from moe_plugin.layers.dispatcher import TokenDispatcher
from moe_plugin.layers.ep_dispatcher import ExpertParallelDispatcher, source_to_expert_order
from moe_plugin.layers.experts import GroupedExperts, SharedExpert, ffn_shard, grouped_mm_supported
from moe_plugin.layers.moe_layer import AttachAuxLoss, MoELayer, MoEStats, StatsSum, moe_layers, reduce_stats
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.reference import ReferenceResult, reference_moe
from moe_plugin.layers.router import Router, RouterNoise, RoutingPlan, expert_capacity, route

__all__ = [
    "AttachAuxLoss", "ExpertParallelDispatcher", "GroupedExperts", "LayerParallelism", "MoELayer", "MoEStats",
    "ReferenceResult", "Router", "RouterNoise", "RoutingPlan", "SharedExpert", "StatsSum", "TokenDispatcher",
    "expert_capacity", "ffn_shard", "grouped_mm_supported", "moe_layers", "reduce_stats", "reference_moe", "route",
    "source_to_expert_order",
]
