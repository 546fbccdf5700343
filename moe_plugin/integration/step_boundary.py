"""What the MoE layers do once per optimizer step, at the step boundary (``initialize`` installs it).

* ``bias_update_rate`` > 0 (aux-loss-free balancing): ``MoELayer.update_expert_bias``, from the
  load of every training forward of the step that ended (all its micro-batches; evaluation
  forwards, in eval mode, are not counted), summed over the ranks that route distinct tokens, so
  the bias stays identical on all of them. Each pipeline stage updates its own layers. A router whose
  weight is frozen (``requires_grad`` False, the example's ``--freeze-router``) keeps its bias as well.
* ``aux_loss_scope`` global: ``MoELayer.reset_balance_counts``, so the micro-batches of one step
  count together (``layers/balance.py``).

DeepSpeed has no public callback after its optimizer step, so a forward pre-hook on the model
does both at the first forward after ``engine.global_steps`` changed: the engine and the
``PipelineEngine`` count it up in every ``step`` (every ``train_batch``), so the next step's
forwards route with the updated bias, whichever engine and whether or not an evaluation comes
first. A step that fp16 skips (overflow) still updates the bias: the load it measured is valid,
only its gradients overflowed (Megatron-Core's update runs before the optimizer's overflow check
too). ``apply()`` does it at once (``Initialized.end_step``); ``save_checkpoint`` calls it, so a
checkpoint holds the bias after the last step and no pending load. Collective where
``bias_update_rate`` > 0: every rank of a layer's token group runs the same forwards.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from moe_plugin.layers.moe_layer import MoELayer


class StepBoundary:
    """The hook on ``model`` (module docstring); ``remove()`` takes it off."""

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
        """The step boundary now: the bias update from the load counted since the last one (none
        counted: the bias stays), the balance counts reset. Collective (module docstring)."""
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
