"""Load-adaptive expert placement (SmartMoE-style): which EP rank hosts which expert.

* ``trace``: gate traces, the per-step tokens per expert and sender x expert traffic of every
  MoE layer in a compact binary file (the planner's input).
* ``tracking``: ``LoadTracker``, every layer's windowed load from the gate (forward hooks).
* ``policies``: pure placement functions (static, greedy, network-aware, imbalance, align).
* ``costs``: the cost of an MoE layer under a placement, the collectives it runs and the one
  switching rule (pure; the planner uses it too).
* ``controller``: ``PlacementController``, which switches by that rule; with ``replica_budget``
  it also shadows hot experts (``layers/shadow.py``, ``docs/placement.md``).
"""
from moe_plugin.placement.controller import PlacementController
from moe_plugin.placement.costs import CostModel
from moe_plugin.placement.policies import greedy, imbalance, network_aware, static
from moe_plugin.placement.trace import GateTrace, TraceMeta, TraceWriter, read_trace
from moe_plugin.placement.tracking import LoadTracker, WindowLoad

__all__ = ["CostModel", "GateTrace", "LoadTracker", "PlacementController", "TraceMeta", "TraceWriter", "WindowLoad",
           "greedy", "imbalance", "network_aware", "read_trace", "static"]
