"""Two-stage automatic parallelization, offline stage: cost model, layout search, trace replay.

    model = ModelSpec.load("examples/gpt_moe/planner/gpt_moe_125m_e64.json")
    cluster = ClusterSpec.load("examples/gpt_moe/planner/cluster_8x8_a100.json")
    candidates = search(model, cluster)            # every valid layout, costed, fitting ones first
    pool = candidate_pool(candidates, 5)           # one per parallel shape
    replay(model, cluster, pool[0].layout, trace.load, Policy("greedy", interval=100))

``moe-plugin plan`` drives it (plan.py); ``calibrate.py`` measures this machine; ``validate.py``
compares predictions with measured steps. Nothing here imports torch at import time.
"""
from moe_plugin.planner.cost_model import StepCost, bubble_fraction, fits, moe_layer_time, stage_memory, step_cost
from moe_plugin.planner.search import Candidate, candidate_pool, ds_config, layouts, search
from moe_plugin.planner.simulator import Policy, Replay, replay, synthetic_trace
from moe_plugin.planner.spec import ClusterSpec, Layout, ModelSpec

__all__ = ["Candidate", "ClusterSpec", "Layout", "ModelSpec", "Policy", "Replay", "StepCost", "bubble_fraction",
           "candidate_pool", "ds_config", "fits", "layouts", "moe_layer_time", "replay", "search", "stage_memory",
           "step_cost", "synthetic_trace"]
