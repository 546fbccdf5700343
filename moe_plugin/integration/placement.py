"""Load-adaptive expert placement in a training loop: tracker, controller, migration and trace in one call.

    placement = training_placement(run, run_dir="runs/my_run")   # None when there is nothing to do
    placement.step(step)                 # every rank, after each engine.step() / train_batch

Design (what it builds, the CPU cost model, its logs): docs/design/integration_placement.md.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from moe_plugin.layers.moe_layer import MoELayer
from moe_plugin.placement import migration
from moe_plugin.placement.controller import Decision, PlacementController
from moe_plugin.placement.costs import CostModel
from moe_plugin.placement.tracking import trace_name

CPU_FLOPS = 2e10   # FLOP/s of one CPU core running fp32 GEMMs, order of magnitude


def cpu_cost_model(layer: MoELayer) -> CostModel:
    """The cost model for CPU runs: routes priced by their FLOPs at ``CPU_FLOPS``, migration at gloo's measured rate."""
    x = layer.experts
    ffn = x.weight2.shape[1] * layer.parallel.etp_size        # weight2: [E_local, F/etp, H]
    flops_per_route = 12 * layer.hidden_size * ffn * (1.5 if x.weight1.shape[-1] == 2 * x.weight2.shape[1] else 1)
    return CostModel(seconds_per_route=flops_per_route / CPU_FLOPS,
                     migration_seconds_per_byte=migration.CPU_GLOO_SECONDS_PER_BYTE)


def _default_cost(layers: dict[str, MoELayer]) -> CostModel:
    from deepspeed.accelerator import get_accelerator

    first = next(iter(layers.values()), None)
    if get_accelerator().device_name() == "cpu" and first is not None:
        return cpu_cost_model(first)
    return CostModel()


class TrainingPlacement:
    """A ``PlacementController`` driven from a training loop, with its totals; built by ``training_placement``."""

    def __init__(self, run: Any, controller: PlacementController):
        self.run, self.controller = run, controller
        self.switches = 0                  # checks at which at least one layer switched
        self.last_switch_step: Optional[int] = None
        self.migration_seconds = 0.0       # this rank's measured time in migrate()
        self.imbalance: Optional[float] = None   # mean over layers of max/mean EP-rank load, last check
        self._migrate_fn = controller.migrate_fn
        controller.migrate_fn = self._migrate
        layers = controller.layers
        controller._log({"event": "start", "policy": controller.config.policy,
                         "check_interval": controller.config.check_interval, "window": controller.config.window,
                         "ep_size": controller.ep_size, "cost_model": controller.cost.__dict__,
                         "layers": {n: trace_name(n, m) for n, m in layers.items()},
                         "placements": {n: m.placement.tolist() for n, m in layers.items()}},
                        f"placement: policy {controller.config.policy}, check every "
                        f"{controller.config.check_interval} steps over a window of {controller.config.window}")

    def _migrate(self, new_placements):
        report = self._migrate_fn(new_placements)
        self.migration_seconds += float(getattr(report, "seconds", 0.0) or 0.0)
        return report

    config = property(lambda self: self.controller.config)
    tracker = property(lambda self: self.controller.tracker)

    def step(self, step: int) -> list[Decision]:
        """Close step ``step`` (every rank, after the optimizer step): track its load; check, maybe migrate."""
        decisions = self.controller.step(step)
        if decisions:
            if any(d.switch for d in decisions):
                self.switches += 1
                self.last_switch_step = step
            after = [d.imbalance_new if d.switch else d.imbalance_now for d in decisions]
            self.imbalance = sum(after) / len(after)
        return decisions

    def summary(self) -> str:
        """Compact text for a progress line, e.g. ``placement greedy: 2 switches (last step 10), ...``."""
        text = f"placement {self.config.policy}"
        if self.config.replica_budget:
            shadowed = sum(len(m.shadowed_experts()) for m in self.controller.layers.values())
            text += f" ({shadowed} shadowed expert{'s' if shadowed != 1 else ''})"
        if self.config.policy == "static":
            return text + (" (tracing)" if self.tracker.tracing else "")
        text += f": {self.switches} switch{'es' if self.switches != 1 else ''}"
        if self.last_switch_step is not None:
            text += f" (last step {self.last_switch_step + 1})"
        if self.imbalance is not None:
            text += f", rank imbalance {self.imbalance:.2f}"
        return text + f", migrations {self.migration_seconds:.2f} s"

    def close(self) -> None:
        """Remove the hooks and close the trace."""
        self.controller.close()


def training_placement(run: Any, run_dir: Union[str, Path, None] = None, *, cost: Optional[CostModel] = None,
                       resumed: bool = False) -> Optional[TrainingPlacement]:
    """Placement for ``run`` (``initialize``'s result) from its ``moe.placement`` block, or None when there is nothing
    to do. ``run_dir``: where ``placement.jsonl`` and a relative ``trace_file`` go. ``cost``: default
    ``cpu_cost_model`` on CPU, else ``CostModel()``. ``resumed``: append to the trace and the log."""
    if not hasattr(run, "engine") or not hasattr(run, "moe_config"):
        raise TypeError(f"training_placement takes what moe_plugin.initialize returned, got {type(run).__name__}")
    config = run.moe_config.placement
    if config.policy == "static" and config.trace_file is None and config.replica_budget == 0:
        return None
    layers = migration.moe_layers(run.engine.module)
    info = {"policy": config.policy, "check_interval": config.check_interval,
            "module_names": {n: trace_name(n, m) for n, m in layers.items()}}
    zero_stage = int(run.engine.zero_optimization_stage())

    def moved_bytes(_name: str, layer: MoELayer, old, new) -> int:
        per_expert = migration.expert_bytes(layer, zero_stage, with_grads=False)
        return migration.moved_bytes(old, new, layer.parallel.ep_size, per_expert)

    controller = PlacementController(run, config, lambda placements: migration.migrate(run, placements),
                                     cost=cost if cost is not None else _default_cost(layers), run_dir=run_dir,
                                     moved_bytes_fn=moved_bytes, append_log=resumed, trace_info=info)
    return TrainingPlacement(run, controller)


def read_placement_log(path: Union[str, Path]) -> list[dict]:
    """The records of a ``placement.jsonl`` (one JSON object per line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
