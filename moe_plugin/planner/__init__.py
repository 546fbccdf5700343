"""Two-stage automatic parallelization, offline stage: cost model, layout search, trace replay.

    model = PlanModel.build("ds.json", "shape.json")     # the run's DeepSpeed JSON and the model's shape
    candidates = search(model, ClusterSpec.load("cluster.json"))   # costed, ranked
    pool = candidate_pool(candidates, 5)           # one per parallel shape

``moe-plugin plan`` drives it (``plan.py``). Nothing here imports torch at import time. docs/planner.md.
"""
from moe_plugin.planner.cost_model import StepCost, bubble_fraction, fits, moe_layer_time, stage_memory, step_cost
from moe_plugin.planner.search import Candidate, candidate_pool, ds_config, layouts, search
from moe_plugin.planner.simulator import Policy, Replay, replay, synthetic_trace
from moe_plugin.planner.spec import ClusterSpec, Layout, ModelShape, PlanModel, PlanOptions

__all__ = ["Candidate", "ClusterSpec", "Layout", "ModelShape", "PlanModel", "PlanOptions", "Policy", "Replay",
           "StepCost", "bubble_fraction", "candidate_pool", "ds_config", "fits", "layouts", "moe_layer_time", "replay",
           "search", "stage_memory", "step_cost", "synthetic_trace"]
