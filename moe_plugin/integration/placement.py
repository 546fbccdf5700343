"""Load-adaptive expert placement in a training loop: tracker, controller, migration and trace in one call.

    run = moe_plugin.initialize(ds_config, model_provider)
    placement = training_placement(run, run_dir="runs/my_run")   # None when there is nothing to do
    for step in range(steps):
        ...                                      # forwards, backward, engine.step() (or train_batch)
        if placement is not None:
            placement.step(step)                 # every rank, at the step boundary
    if placement is not None:
        placement.close()

What it builds from the ``"moe.placement"`` block (``configs/schema.py``): nothing when the
policy is ``static`` and no ``trace_file`` is set (no hooks, no collectives). Otherwise a
``LoadTracker`` (forward hooks on every ``MoELayer``; ``trace_file`` relative to ``run_dir``)
and a ``PlacementController`` whose ``migrate_fn`` is the real ``placement.migration.migrate``
(weights, ZeRO-0 gradients and optimizer state, ZeRO-1/2 partitions) and whose
``moved_bytes_fn`` is ``migration.moved_bytes`` with ``migration.expert_bytes`` for the
engine's ZeRO stage. A static policy with a trace only records the gate; it never switches.

The cost model. Its defaults describe a GPU cluster. On CPU (DeepSpeed's accelerator is
``cpu``) the migration cost is ``migration.CPU_GLOO_SECONDS_PER_BYTE`` (measured) and the
seconds of a route through an expert are estimated from its FLOPs: forward and backward are
three passes of two GEMMs, ``12 * H * F`` FLOPs per route (``F`` doubled by a GLU), at
``CPU_FLOPS`` per second (one core's order of magnitude). The estimate only has to rank a
switch against a migration; pass ``cost=`` to replace it by a measured one
(``CostModel.fit``).

Where it logs: every check and switch goes to ``placement.jsonl`` in ``run_dir``
(``placement.stage<k>.jsonl`` per pipeline stage), after one ``"start"`` record that names the
layers (module name -> trace name) and their placements at the start. ``summary()`` is a
compact text for a progress line, ``switches`` and ``migration_seconds`` are the totals.

Pipelines: the tracker and the controller handle pipeline stages (a stage decides its own
layers; the switch flag is agreed over the pipeline group; ``migrate`` is collective over the
job), so ``step`` is called after ``engine.train_batch`` on every rank, like above.
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
    """The cost model for CPU runs (module docstring): FLOP-estimated routes, measured migration."""
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
    """A ``PlacementController`` driven from a training loop, with its totals (module docstring).
    Build it with ``training_placement``."""

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
        """Close step ``step`` (every rank, after ``engine.step()`` / ``train_batch``): track its load,
        write its trace record and, every ``check_interval`` steps, check and maybe migrate."""
        decisions = self.controller.step(step)
        if decisions:
            if any(d.switch for d in decisions):
                self.switches += 1
                self.last_switch_step = step
            after = [d.imbalance_new if d.switch else d.imbalance_now for d in decisions]
            self.imbalance = sum(after) / len(after)
        return decisions

    def summary(self) -> str:
        """Compact text for a progress line, e.g. ``placement greedy: 2 switches (last step 10),
        rank imbalance 1.06, migrations 0.12 s``."""
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
    """Set up load-adaptive placement for ``run`` (what ``moe_plugin.initialize`` returned) from
    its ``moe.placement`` block, or None when the policy is static and neither a trace nor shadow
    experts (``replica_budget``) are asked for.

    ``run_dir``: where ``placement.jsonl`` and a relative ``trace_file`` go (default: the current
    directory for the trace, no log file). ``cost``: the controller's cost model (default:
    ``cpu_cost_model`` on CPU, ``CostModel()`` otherwise). ``resumed``: append to the existing
    trace and ``placement.jsonl`` (a run resumed from a checkpoint); otherwise both start anew."""
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
