"""Load-adaptive expert placement (SmartMoE-style): which EP rank hosts which expert.

``tracking`` (windowed load from the gate) and ``trace`` (gate traces for the planner), ``policies``
(pure placement functions), ``costs`` (a layer's cost and the one switching rule, the planner's
too), ``controller`` (when to switch, what to shadow), ``migration`` (moving expert state),
``rules`` (which exchanges placement's options allow). docs/placement.md.
"""
from moe_plugin.placement.controller import PlacementController
from moe_plugin.placement.costs import CostModel
from moe_plugin.placement.policies import greedy, imbalance, network_aware, static
from moe_plugin.placement.trace import GateTrace, TraceMeta, TraceWriter, read_trace
from moe_plugin.placement.tracking import LoadTracker, WindowLoad

__all__ = ["CostModel", "GateTrace", "LoadTracker", "PlacementController", "TraceMeta", "TraceWriter", "WindowLoad",
           "greedy", "imbalance", "network_aware", "read_trace", "static"]
