"""What the MoE layers do once per optimizer step (``initialize`` installs it): the aux-loss-free bias update
(``bias_update_rate`` > 0; a frozen router keeps its bias) and, with ``aux_loss_scope`` global, the balance
counts reset, at the first forward after ``engine.global_steps`` changed. docs/long_runs.md, *Once per optimizer step*.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from moe_plugin.layers.moe_layer import MoELayer


class StepBoundary:
    """The forward pre-hook on ``model``; ``remove()`` takes it off."""

    def __init__(self, engine: Any, model: nn.Module):
        self.engine = engine
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.bias_layers = [m for m in layers if m.config.bias_update_rate > 0]
        self.count_layers = [m for m in layers if m.config.aux_loss_scope == "global"]
        self._seen: Optional[int] = None   # engine.global_steps when the boundary was last applied
        self._handle = None
        if self.bias_layers or self.count_layers:
            self._handle = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self.engine.global_steps != self._seen:
            self.apply()

    def apply(self) -> None:
        """The step boundary now: bias update from the load counted since the last one, counts reset (collective)."""
        self._seen = self.engine.global_steps
        for layer in self.bias_layers:
            if layer.router.weight.requires_grad:
                layer.update_expert_bias()
            else:   # a frozen router (--freeze-router) keeps its bias too: its choices stay as they are
                layer.router.load_E.zero_()
        for layer in self.count_layers:
            layer.reset_balance_counts()

    def restart(self) -> None:
        """The next forward starts a step whatever the step counter says (after a checkpoint load)."""
        self._seen = None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
