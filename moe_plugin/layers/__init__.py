"""MoE layers: router, token dispatcher, grouped experts, the MoE layer and its reference oracle."""
from moe_plugin.layers.dispatcher import TokenDispatcher
from moe_plugin.layers.experts import GroupedExperts, SharedExpert, grouped_mm_supported
from moe_plugin.layers.moe_layer import AttachAuxLoss, MoELayer, MoEStats
from moe_plugin.layers.reference import ReferenceResult, reference_moe
from moe_plugin.layers.router import Router, RouterNoise, RoutingPlan, expert_capacity, route

__all__ = [
    "AttachAuxLoss", "GroupedExperts", "MoELayer", "MoEStats", "ReferenceResult", "Router", "RouterNoise",
    "RoutingPlan", "SharedExpert", "TokenDispatcher", "expert_capacity", "grouped_mm_supported", "reference_moe",
    "route",
]
