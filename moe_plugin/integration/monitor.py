"""Expert load metrics of a step, into DeepSpeed's monitor and a short log line.

    metrics = ExpertMetrics(engine.module)     # hooks every MoELayer; the step's training forwards add up
    metrics.collect(); metrics.write(engine, step); print(metrics.log_line())   # collect: collective

What each metric counts: docs/design/integration_monitor.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.layers.moe_layer import MoELayer, StatsSum, reduce_stats

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups

EVENT_PREFIX = "MoE"


@dataclass(frozen=True)
class LayerMetrics:
    """One MoE layer's metrics over the training forwards since the last ``collect()``."""

    layer: int
    tokens_per_expert: list[int]
    kept_per_expert: list[int]
    dropped_fraction: float
    aux_loss: float
    z_loss: float
    forwards: int
    expert_bias: list[float] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        total = sum(self.tokens_per_expert)
        return max(self.tokens_per_expert) * len(self.tokens_per_expert) / total if total else 0.0


class ExpertMetrics:
    """Expert load metrics of every ``MoELayer`` in ``model``. ``groups``: needed only on a pipeline stage
    without MoE layers, which must still join ``collect()``. ``per_expert``: also one event per expert."""

    def __init__(self, model: nn.Module, *, groups: Optional["ProcessGroups"] = None, per_expert: bool = True):
        self.layers: list[tuple[int, MoELayer]] = []
        for order, module in enumerate(m for m in model.modules() if isinstance(m, MoELayer)):
            index = getattr(module, "layer_index", None)
            self.layers.append((order if index is None else int(index), module))
        if not self.layers and groups is None:
            raise ValueError(f"{type(model).__name__} has no MoELayer: nothing to measure (build the model with "
                             "the plugin's MoE layers, e.g. gpt_moe_spec; on a pipeline stage without MoE layers "
                             "pass groups=...)")
        self.groups = groups if groups is not None else self.layers[0][1].groups
        self.per_expert = per_expert
        self._z_on = any(layer.config.z_loss_coeff > 0 for _, layer in self.layers)
        self._sums = {index: StatsSum() for index, _ in self.layers}
        self._bias: dict[int, torch.Tensor] = {}
        self._hooks = [layer.register_forward_hook(self._hook(index)) for index, layer in self.layers]
        self.metrics: list[LayerMetrics] = []

    def _hook(self, index: int):
        def add(module: MoELayer, _inputs: Any, _output: Any) -> None:
            if module.training and torch.is_grad_enabled() and module.last_stats is not None:
                self._sums[index].add(module.last_stats)
                self._bias[index] = module.router.expert_bias.detach().clone()
        return add

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def reset(self) -> None:
        """Forget the forwards counted since the last ``collect()`` (local, no collective)."""
        for acc in self._sums.values():
            acc.reset()

    def collect(self) -> list[LayerMetrics]:
        """Reduce and reset the sums; every layer's metrics, by layer, on every rank (collective)."""
        local: list[LayerMetrics] = []
        for index, layer in self.layers:
            acc = self._sums[index]
            if acc.forwards == 0:
                raise RuntimeError(f"MoE layer {index} ran no training forward since the last collect(); call "
                                   "collect() once per step, after the step's forwards")
            stats = reduce_stats(acc.as_stats(), layer.parallel.tokens)
            routed, kept = stats.routed_per_expert.tolist(), stats.kept_per_expert.tolist()
            local.append(LayerMetrics(layer=index, tokens_per_expert=routed, kept_per_expert=kept,
                                      dropped_fraction=1.0 - sum(kept) / sum(routed) if sum(routed) else 0.0,
                                      aux_loss=float(stats.balance_loss), z_loss=float(stats.z_loss),
                                      forwards=acc.forwards, expert_bias=self._bias[index].tolist()))
            acc.reset()
        self.metrics = sorted(self._gather_stages(local), key=lambda m: m.layer)
        return self.metrics

    def _gather_stages(self, local: list[LayerMetrics]) -> list[LayerMetrics]:
        """Every pipeline stage's layers, all-gathered over the pipeline group (when there is one)."""
        pp = self.groups.pp if self.groups is not None else None
        if pp is None or dist.get_world_size(pp) == 1:
            return local
        stages: list = [None] * dist.get_world_size(pp)
        dist.all_gather_object(stages, local, group=pp)
        return [m for stage in stages for m in stage]

    def events(self, step: int) -> list[tuple[str, float, int]]:
        """The collected metrics as DeepSpeed monitor events ``(name, value, step)``."""
        out = []
        for m in self.metrics:
            name = f"{EVENT_PREFIX}/layer{m.layer}"
            out += [(f"{name}/imbalance", m.imbalance, step), (f"{name}/dropped_fraction", m.dropped_fraction, step),
                    (f"{name}/aux_loss", m.aux_loss, step), (f"{name}/z_loss", m.z_loss, step)]
            if self.per_expert:
                out += [(f"{name}/tokens_expert{e}", float(n), step) for e, n in enumerate(m.tokens_per_expert)]
        return out

    def write(self, engine: Any, step: Optional[int] = None) -> None:
        """Write the metrics to ``engine.monitor`` at ``step`` (default ``engine.global_samples``); not collective."""
        if not self.metrics:
            raise RuntimeError("nothing collected yet: call collect() (on every rank) before write()")
        monitor = getattr(engine, "monitor", None)
        if monitor is None or not monitor.enabled:
            return
        monitor.write_events(self.events(engine.global_samples if step is None else step))

    def log_line(self) -> str:
        """``moe: imb 1.23 (max L2) drop 0.4% aux 1.012``: worst imbalance and its layer, drops, mean aux (z) loss."""
        if not self.metrics:
            return "moe: -"
        worst = max(self.metrics, key=lambda m: m.imbalance)
        routed = sum(sum(m.tokens_per_expert) for m in self.metrics)
        kept = sum(sum(m.kept_per_expert) for m in self.metrics)
        drop = 100.0 * (routed - kept) / routed if routed else 0.0
        aux = sum(m.aux_loss for m in self.metrics) / len(self.metrics)
        z = sum(m.z_loss for m in self.metrics) / len(self.metrics)
        line = f"moe: imb {worst.imbalance:.2f} (max L{worst.layer}) drop {drop:.1f}% aux {aux:.3f}"
        return line + (f" z {z:.3g}" if self._z_on else "")
