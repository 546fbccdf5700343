"""Offline strategy search: every valid layout of a world size, costed, filtered by memory, ranked.

A layout is valid when the plugin's own config checks accept it and DeepSpeed would run it; the candidate
pool is the fastest fitting layouts, one per parallel shape (tp, pp, ep, etp). docs/planner.md, *The search*.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.planner.cost_model import StepCost, fits, step_cost
from moe_plugin.planner.spec import TOTAL, ClusterSpec, Layout, PlanModel

PIPELINE_ZERO = (0, 1)
ZERO_STAGES = (0, 1, 2)
# what a candidate gets where the run's JSON has none
LAUNCH_DEFAULTS = {"gradient_clipping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}


@dataclass
class Candidate:
    layout: Layout
    cost: StepCost
    fits: bool

    @property
    def time(self) -> float:
        return self.cost.total

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layout.tp, self.layout.pp, self.layout.ep, self.layout.etp


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def moe_block(model: PlanModel, layout: Layout, placement: Optional[dict] = None) -> dict:
    """The run's ``"moe"`` block with ``layout``'s parallel sizes (and ``placement`` when given)."""
    block = dict(model.ds_config["moe"])
    block["parallel"] = {"tensor": layout.tp, "pipeline": layout.pp, "expert": layout.ep,
                         "expert_tensor": layout.etp, "order": layout.order}
    if placement is not None:
        block["placement"] = dict(placement)
    return block


def ds_config(model: PlanModel, layout: Layout, placement: Optional[dict] = None) -> dict:
    """The run's DeepSpeed JSON under ``layout``: its batch split, ZeRO stage and ``"moe"`` block (``moe_block``)
    set, ``LAUNCH_DEFAULTS`` where the run's JSON has no clipping or optimizer; the rest as the run's JSON."""
    run = model.ds_config
    config = {TOTAL: model.global_batch, "train_micro_batch_size_per_gpu": layout.micro_batch,
              "gradient_accumulation_steps": layout.gas}
    config.update((k, v) for k, v in LAUNCH_DEFAULTS.items() if k not in run)
    config["zero_optimization"] = {**run.get("zero_optimization", {}), "stage": layout.zero}
    config.update((k, v) for k, v in run.items() if k not in config and k != "moe")
    config["moe"] = moe_block(model, layout, placement)
    return copy.deepcopy(config)


def layouts(model: PlanModel, cluster: ClusterSpec, world_size: Optional[int] = None) -> Iterator[Layout]:
    """Every valid layout of ``world_size`` ranks (default: the cluster's)."""
    world = world_size or cluster.world_size
    shape = model.shape
    model_parallel_sizes = (shape.num_attention_heads, shape.query_groups, shape.ffn, model.expert_ffn)
    for pp in divisors(world):
        if shape.num_layers % pp or (pp > 1 and not _moe_on_every_stage(model, pp)):
            continue
        stage = world // pp
        for tp in divisors(stage):
            if tp > cluster.gpus_per_node or any(n % tp for n in model_parallel_sizes):
                continue
            dp = stage // tp
            for etp in sorted({1, tp}):
                for ep in divisors(model.moe.num_experts):
                    sizes = Layout(tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, zero=0, micro_batch=1, gas=1)
                    if stage % (ep * etp) or not _valid(model, world, sizes):
                        continue
                    for mb in model.options.micro_batches:
                        if model.global_batch % (mb * dp):
                            continue
                        gas = model.global_batch // (mb * dp)
                        for zero in (PIPELINE_ZERO if pp > 1 else ZERO_STAGES):
                            yield Layout(tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, zero=zero, micro_batch=mb, gas=gas)


def _moe_on_every_stage(model: PlanModel, pp: int) -> bool:
    per = model.shape.num_layers // pp
    return all(any(model.moe.is_moe_layer(i) for i in range(s * per, (s + 1) * per)) for s in range(pp))


def _valid(model: PlanModel, world: int, sizes: Layout) -> bool:
    """Whether the plugin's own config checks accept the run's ``"moe"`` block with these parallel sizes."""
    try:
        MoEConfig.from_dict(moe_block(model, sizes, {"policy": "static"})).check_world_size(world)
    except ConfigError:
        return False
    return True


def search(model: PlanModel, cluster: ClusterSpec, *, load_ME=None, world_size: Optional[int] = None,
           progress: Optional[Callable[[int, int], None]] = None) -> list[Candidate]:
    """All valid layouts, costed and sorted: those that fit first, fastest first."""
    todo = list(layouts(model, cluster, world_size))
    if not todo:
        raise ConfigError("cluster", f"{world_size or cluster.world_size} ranks", "no valid layout for this model "
                          "on this many ranks (check train_batch_size, --micro-batches, the shape's heads and layers)")
    out = []
    for n, layout in enumerate(todo, 1):
        cost = step_cost(model, cluster, layout, load_ME)
        out.append(Candidate(layout, cost, fits(cost, cluster)))
        if progress is not None:
            progress(n, len(todo))
    out.sort(key=lambda c: (not c.fits, c.time))
    return out


def candidate_pool(candidates: list[Candidate], top: int) -> list[Candidate]:
    """The ``top`` fastest fitting candidates, one per parallel shape (tp, pp, ep, etp)."""
    pool, seen = [], set()
    for c in candidates:
        if c.fits and c.shape not in seen:
            pool.append(c)
            seen.add(c.shape)
            if len(pool) == top:
                break
    return pool


class Progress:
    """A one-line progress display on stderr, refreshed at most every ``every`` seconds."""

    def __init__(self, label: str, every: float = 0.5, stream=sys.stderr):
        self.label, self.every, self.stream = label, every, stream
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self._last >= self.every:
            self._last = now
            end = "\n" if done == total else ""
            self.stream.write(f"\r{self.label}: {done}/{total} layouts{end}")
            self.stream.flush()
