"""Load-adaptive expert placement (SmartMoE-style): which EP rank hosts which expert.

* ``trace``: gate traces, the per-step tokens per expert and sender x expert traffic of every
  MoE layer in a compact binary file (the planner's input).
"""
from moe_plugin.placement.trace import GateTrace, TraceMeta, TraceWriter, read_trace

__all__ = ["GateTrace", "TraceMeta", "TraceWriter", "read_trace"]
