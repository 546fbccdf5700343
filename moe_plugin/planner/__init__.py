"""Two-stage automatic parallelization, offline stage: cost model, layout search, trace replay.

    candidates = search(ModelSpec.load("model.json"), ClusterSpec.load("cluster.json"))   # costed, ranked
    pool = candidate_pool(candidates, 5)           # one per parallel shape

``moe-plugin plan`` drives it (``plan.py``). Nothing here imports torch at import time. docs/planner.md.
"""
from moe_plugin.planner.cost_model import StepCost, bubble_fraction, fits, moe_layer_time, stage_memory, step_cost
from moe_plugin.planner.search import Candidate, candidate_pool, ds_config, layouts, search
from moe_plugin.planner.simulator import Policy, Replay, replay, synthetic_trace
from moe_plugin.planner.spec import ClusterSpec, Layout, ModelSpec

__all__ = ["Candidate", "ClusterSpec", "Layout", "ModelSpec", "Policy", "Replay", "StepCost", "bubble_fraction",
           "candidate_pool", "ds_config", "fits", "layouts", "moe_layer_time", "replay", "search", "stage_memory",
           "step_cost", "synthetic_trace"]
