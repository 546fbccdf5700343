"""Switching: when to give MoE layers a new expert placement, and which experts to shadow.

    controller = PlacementController(run, moe_config.placement, lambda p: migrate(run, p), run_dir="run")
    controller.step(step)          # every rank, after engine.step(); every check_interval steps it checks

Decisions are the same on every rank of a stage; all switches of a check go to one collective
``migrate_fn`` call; every check is logged. How: docs/design/placement_switching.md.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.configs.schema import PlacementConfig
from moe_plugin.layers.moe_layer import MoELayer, moe_layers
from moe_plugin.placement import policies
from moe_plugin.placement.costs import CostModel, hottest, should_switch
from moe_plugin.placement.tracking import LoadTracker, WindowLoad, collective_device

logger = logging.getLogger("moe_plugin.placement")

MigrateFn = Callable[[dict[str, Tensor]], Any]
MovedBytesFn = Callable[[str, MoELayer, Tensor, Tensor], int]
STATE_BYTES_PER_PARAM = 12   # fp32 master weight + Adam's two moments


@dataclass(frozen=True)
class Decision:
    """One layer at one check."""

    step: int
    layer: str
    switch: bool
    reason: str
    imbalance_now: float
    imbalance_new: float
    seconds_now: float          # predicted per step, current placement
    seconds_new: float          # predicted per step, proposed placement
    saving: float               # predicted seconds saved until the next check
    migration_cost: float       # predicted seconds of the migration
    moved_bytes: int
    realised_seconds: Optional[float] = None   # model on this window's load, placement in effect
    predicted_at_last_check: Optional[float] = None
    measured_seconds: Optional[float] = None   # mean of step(..., layer_seconds=) since the last check
    placement: Optional[list[int]] = None      # the new placement, when it switches
    # Shadow experts (only with replica_budget > 0), under the placement in effect after this check:
    shadow_now: Optional[list[int]] = None       # shadowed experts before the check
    shadow_new: Optional[list[int]] = None       # the new set, when it changes
    shadow_seconds_now: Optional[float] = None   # predicted per step with shadow_now
    shadow_seconds_new: Optional[float] = None   # predicted per step with the best set
    shadow_reason: Optional[str] = None

    def record(self) -> dict:
        return {"event": "check", **{k: v for k, v in self.__dict__.items() if v is not None}}


def default_moved_bytes(_name: str, layer: MoELayer, old: Tensor, new: Tensor) -> int:
    """A rough upper bound of the bytes a placement change moves (``migration.moved_bytes``: exact)."""
    x, p = layer.experts, layer.parallel
    params = sum(w[0].numel() for w in (x.weight1, x.weight2)) * p.etp_size
    per_expert = params * (x.weight1.element_size() + STATE_BYTES_PER_PARAM) * p.edp_size
    return len(policies.moved_experts(old, new, p.ep_size)) * per_expert


class PlacementController:
    """Checks and switches the placement of every MoE layer of ``model`` (or of what
    ``moe_plugin.initialize`` returned); ``migrate_fn(new_placements)`` moves the experts, collective
    over the job. The arguments: docs/design/placement_switching.md."""

    def __init__(self, model: Union[nn.Module, Any], config: PlacementConfig, migrate_fn: MigrateFn, *,
                 tracker: Optional[LoadTracker] = None, cost: CostModel = CostModel(),
                 run_dir: Union[str, Path, None] = None, moved_bytes_fn: MovedBytesFn = default_moved_bytes,
                 node_of_rank: Optional[Sequence[int]] = None, groups: Any = None, append_log: bool = False,
                 trace_info: Optional[dict] = None):
        if hasattr(model, "engine") and hasattr(model, "groups"):
            model, groups = model.engine.module, groups or model.groups
        self.model, self.config, self.migrate_fn = model, config, migrate_fn
        self.cost, self.moved_bytes_fn = cost, moved_bytes_fn
        self.layers: dict[str, MoELayer] = moe_layers(model)
        first = next(iter(self.layers.values()), None)
        self.groups = groups if groups is not None else (first.groups if first is not None else None)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if tracker is None:
            trace = config.trace_file
            if trace is not None and self.run_dir is not None and not os.path.isabs(trace):
                trace = self.run_dir / trace
            tracker = LoadTracker(model, config.window, groups=self.groups, trace_path=trace, trace_info=trace_info,
                                  trace_append=append_log)
        self.tracker = tracker
        self.ep_size = first.parallel.ep_size if first is not None else 1
        self.node_of_rank = list(node_of_rank) if node_of_rank is not None else self._nodes()
        if len(self.node_of_rank) != self.ep_size:
            raise ValueError(f"node_of_rank must name the node of each of the {self.ep_size} EP ranks, "
                             f"got {self.node_of_rank}")
        self.decisions: list[Decision] = []
        self._predicted: dict[str, float] = {}            # per-step seconds predicted at the last check
        self._measured: dict[str, list[float]] = {n: [] for n in self.layers}
        self._writes_log = self.groups is None or self.groups.rank_in("tp_dp") == 0
        self._log_path = self._log_file() if self._writes_log else None
        if self._log_path is not None and not append_log:
            self._log_path.write_text("")      # a new run's log

    # -- setup -------------------------------------------------------------------------------
    def _nodes(self) -> list[int]:
        if self.groups is None or self.ep_size == 1:
            return [0] * self.ep_size
        layout = self.groups.layout
        per_node = self.config.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
        stage = layout.coords(self.groups.rank)["pp"]
        first = min(g for g in layout.groups("ep") if layout.coords(g[0])["pp"] == stage)
        return policies.nodes_of(first, per_node)

    def _log_file(self) -> Optional[Path]:
        g = self.groups
        if self.run_dir is None:
            return None
        stage = g.layout.coords(g.rank)["pp"] if g is not None else 0
        pp = g.layout.sizes.pp if g is not None else 1
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return self.run_dir / ("placement.jsonl" if pp == 1 else f"placement.stage{stage}.jsonl")

    def _log(self, record: dict, line: str) -> None:
        if not self._writes_log:
            return
        logger.info(line)
        if self._log_path is not None:
            with open(self._log_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    # -- per step ----------------------------------------------------------------------------
    def step(self, step: int, layer_seconds: Optional[Mapping[str, float]] = None) -> list[Decision]:
        """Close step ``step`` (every rank, after its forwards); every ``check_interval`` steps check and
        return the decisions ([] between checks). ``layer_seconds``: measured, logged beside the prediction."""
        self.tracker.end_step(step)
        for name, seconds in (layer_seconds or {}).items():
            self._measured.setdefault(name, []).append(float(seconds))
        if ((self.config.policy == "static" and self.config.replica_budget == 0)
                or self.tracker.steps_seen % self.config.check_interval):
            return []
        return self.check(step)

    def propose(self, name: str, load: WindowLoad) -> Tensor:
        """The policy's placement for one layer, relabelled to move few experts."""
        P, current = self.ep_size, self.layers[name].placement.detach().cpu()
        if self.config.policy == "greedy":
            new = policies.greedy(load.kept_E, P)
            return policies.align(new, current, P)
        if self.config.policy == "network-aware":
            new = policies.network_aware(load.kept_E, load.traffic_PE, P, self.node_of_rank, slack=self.config.slack)
            return policies.align(new, current, P, self.node_of_rank)
        return current

    def decide(self, step: int, name: str, load: WindowLoad) -> Decision:
        """Whether layer ``name`` should switch, by ``costs.should_switch``."""
        layer = self.layers[name]
        current = layer.placement.detach().cpu()
        new = self.propose(name, load)
        T = load.per_step()
        bytes_per_route = 4 * layer.hidden_size * layer.experts.weight1.element_size()
        now = self.cost.layer_time(T, current, self.node_of_rank, bytes_per_route)
        after = self.cost.layer_time(T, new, self.node_of_rank, bytes_per_route)
        moved = int(self.moved_bytes_fn(name, layer, current, new)) if not torch.equal(new, current) else 0
        saving = (now.total - after.total) * self.config.check_interval
        cost = moved * self.cost.migration_seconds_per_byte
        if torch.equal(new, current):
            switch, reason = False, "the policy keeps the current placement"
        else:
            switch, reason = should_switch(now.total, after.total, cost, self.config.check_interval,
                                           self.config.min_gain)
        measured = self._measured.get(name) or None
        kept = load.kept_E
        shadow = self.decide_shadow(name, load, new if switch else current)
        return Decision(step=step, layer=name, switch=switch, reason=reason,
                        imbalance_now=policies.imbalance(kept, current, self.ep_size),
                        imbalance_new=policies.imbalance(kept, new, self.ep_size),
                        seconds_now=now.total, seconds_new=after.total, saving=saving, migration_cost=cost,
                        moved_bytes=moved, realised_seconds=now.total,
                        predicted_at_last_check=self._predicted.get(name),
                        measured_seconds=sum(measured) / len(measured) if measured else None,
                        placement=new.tolist() if switch else None, **shadow)

    def decide_shadow(self, name: str, load: WindowLoad, placement: Tensor) -> dict:
        """The shadow-expert fields of a ``Decision`` (empty without ``replica_budget``)."""
        layer, budget = self.layers[name], self.config.replica_budget
        p = layer.parallel
        if budget == 0 or p.ep_size == 1 or p.etp_size > 1 or load.traffic_PE.shape[0] != p.ep_size:
            return {}
        groups = max(1, p.tp_size * p.dp_size // (p.ep_size * p.etp_size))   # EP groups of the stage
        T = load.per_step() / groups
        x = layer.experts
        expert_bytes = (x.weight1[0].numel() + x.weight2[0].numel()) * x.weight1.element_size()
        args = (placement, self.node_of_rank, 4 * layer.hidden_size * x.weight1.element_size())
        hot = hottest(T.sum(0).tolist(), budget)
        times = [self.cost.layer_time(T, *args, shadow=hot[:k], expert_bytes=expert_bytes).total
                 for k in range(len(hot) + 1)]
        k = min(range(len(times)), key=lambda i: (times[i], i))
        best, now = sorted(hot[:k]), layer.shadowed_experts()
        t_now = self.cost.layer_time(T, *args, shadow=now, expert_bytes=expert_bytes).total
        if best == now:
            change, reason = False, "the best shadow set is the current one"
        else:
            change, reason = should_switch(t_now, times[k], 0.0, self.config.check_interval, self.config.min_gain)
            reason = f"shadow {best}: {t_now * 1e3:.3g} -> {times[k] * 1e3:.3g} ms/step, " + reason
        return dict(shadow_now=now, shadow_new=best if change else None, shadow_seconds_now=t_now,
                    shadow_seconds_new=times[k], shadow_reason=reason)

    def check(self, step: int) -> list[Decision]:
        """Decide every layer and migrate the ones that switch, in one ``migrate_fn`` call."""
        loads = self.tracker.window_loads() if self.layers else {}
        decisions = [self.decide(step, name, loads[name]) for name in self.layers]
        for d in decisions:
            self._log(d.record(), f"placement check step {d.step} {d.layer}: imbalance {d.imbalance_now:.3f} -> "
                      f"{d.imbalance_new:.3f}, {d.seconds_now * 1e3:.3f} -> {d.seconds_new * 1e3:.3f} ms/step, "
                      f"{'switch' if d.switch else 'stay'} ({d.reason})"
                      + (f"; shadow {d.shadow_reason}" if d.shadow_reason is not None else ""))
            self._predicted[d.layer] = d.seconds_new if d.switch else d.seconds_now
            self._measured[d.layer] = []
        new = {d.layer: torch.tensor(d.placement, dtype=torch.int64) for d in decisions if d.switch}
        if self._anyone_switches(bool(new)):
            report = self.migrate_fn(new)
            seconds = getattr(report, "seconds", None)
            record = {"event": "switch", "step": step, "layers": sorted(new),
                      "moved_bytes": sum(d.moved_bytes for d in decisions if d.switch),
                      "predicted_migration_seconds": sum(d.migration_cost for d in decisions if d.switch),
                      "measured_migration_seconds": seconds, "sent_bytes": getattr(report, "sent_bytes", None)}
            self._log(record, f"placement switch step {step}: {sorted(new) or 'no layer of this stage'}, "
                      f"{record['moved_bytes']} bytes predicted {record['predicted_migration_seconds']:.3g}s"
                      + (f", measured {seconds:.3g}s" if seconds is not None else ""))
        for d in decisions:
            if d.shadow_new is not None:       # no state moves: the same flags on every rank of the stage
                self.layers[d.layer].set_shadow(d.shadow_new)
                self._log({"event": "shadow", "step": step, "layer": d.layer, "experts": d.shadow_new,
                           "previous": d.shadow_now, "predicted_seconds_now": d.shadow_seconds_now,
                           "predicted_seconds_new": d.shadow_seconds_new},
                          f"placement shadow step {step} {d.layer}: {d.shadow_now} -> {d.shadow_new}")
        self.decisions.extend(decisions)
        return decisions

    def _anyone_switches(self, mine: bool) -> bool:
        """Whether any stage switches (stages decide their own layers; ``migrate_fn`` is collective)."""
        pp = self.groups.pp if self.groups is not None else None
        if pp is None:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int64, device=collective_device(pp, {}))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pp)
        return bool(flag.item())

    def close(self) -> None:
        self.tracker.close()
