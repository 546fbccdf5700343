"""MoELayer: router -> dispatcher -> grouped experts -> combine (+ shared expert).

Shape suffixes: S sequence, B batch, H hidden, T = S*B tokens, R kept routes, L local experts.

``MoELayer(config, hidden_size, ffn_hidden_size, groups=None)`` replaces a Megatron MLP:
``forward(hidden_SBH) -> (output_SBH, None)``. The router runs in fp32, the experts and the
output in the input dtype. The balance and z losses reach the gradients through
``AttachAuxLoss`` on the output: a training loop that calls ``loss.backward()`` trains the
router without adding the losses by hand. ``last_stats`` describes the latest forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from moe_plugin.configs.schema import MoEConfig
from moe_plugin.layers.dispatcher import TokenDispatcher
from moe_plugin.layers.experts import GroupedExperts, SharedExpert
from moe_plugin.layers.router import Router, RouterNoise, RoutingPlan

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also gives ``loss`` the gradient ``scale``.

    So ``d(scale * loss)`` joins the parameter gradients whenever anything downstream of
    ``out`` is backpropagated.
    """

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        dtype, device = ctx.loss_meta
        return grad_out, torch.full((), ctx.scale, dtype=dtype, device=device), None


@dataclass(frozen=True)
class MoEStats:
    """What one forward did; detached tensors (call ``float()``/``tolist()`` when needed)."""

    kept_per_expert: Tensor      # [E] routes each expert processed
    routed_per_expert: Tensor    # [E] routes each expert was chosen for, before capacity
    dropped_fraction: Tensor     # scalar, of routes after random routing
    balance_loss: Tensor         # scalar, before aux_loss_coeff
    z_loss: Tensor               # scalar, before z_loss_coeff
    capacity: Optional[int]


def _ep_coords(groups: Optional["ProcessGroups"]) -> tuple[int, int, str]:
    if groups is None:
        return 1, 0, "ep_size_1"
    return groups.size("ep"), groups.rank_in("ep"), groups.expert_group_name


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP. ``seed`` makes the init deterministic and EP-size independent."""

    def __init__(self, config: MoEConfig, hidden_size: int, ffn_hidden_size: int,
                 groups: Optional["ProcessGroups"] = None, *,
                 seed: int = 0, init_std: float = 0.02, output_init_std: Optional[float] = None):
        super().__init__()
        self.config = config
        self.groups = groups
        self.hidden_size = hidden_size
        ffn = config.ffn_hidden_size or ffn_hidden_size
        ep_size, ep_rank, group_name = _ep_coords(groups)
        self.router = Router(config, hidden_size, seed=seed, init_std=init_std)
        self.dispatcher = TokenDispatcher(config.num_experts, groups)
        self.experts = GroupedExperts(config.num_experts, hidden_size, ffn, config.activation,
                                      ep_size=ep_size, ep_rank=ep_rank, group_name=group_name, seed=seed,
                                      init_std=init_std, output_init_std=output_init_std)
        self.shared_expert = None
        if config.shared_expert_ffn_hidden_size > 0:
            self.shared_expert = SharedExpert(hidden_size, config.shared_expert_ffn_hidden_size, config.activation,
                                              gate=config.shared_expert_gate, seed=seed, init_std=init_std,
                                              output_init_std=output_init_std)
        # Multiplies the aux-loss gradient: set it to the main loss's scale (gradient
        # accumulation, fp16 loss scaling) so both gradients are scaled alike.
        self.aux_loss_scale = 1.0
        self.last_stats: Optional[MoEStats] = None

    def forward(self, hidden_SBH: Tensor, noise: Optional[RouterNoise] = None) -> tuple[Tensor, None]:
        """``noise`` replays given random numbers (tests); by default the router draws its own."""
        if hidden_SBH.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE layer input has hidden size {hidden_SBH.shape[-1]}, expected {self.hidden_size}")
        x_TH = hidden_SBH.reshape(-1, self.hidden_size)
        plan = self.dispatcher.prepare(self.router(x_TH, noise))
        x_RH, counts_L = self.dispatcher.dispatch(x_TH, plan)
        out_TH = self.dispatcher.combine(self.experts(x_RH, counts_L), plan)
        if self.shared_expert is not None:
            out_TH = out_TH + self.shared_expert(x_TH)
        out_TH = self._attach_losses(out_TH, plan)
        self.last_stats = self._stats(plan)
        return out_TH.view(hidden_SBH.shape), None

    def _attach_losses(self, out_TH: Tensor, plan: RoutingPlan) -> Tensor:
        cfg = self.config
        if not (self.training and torch.is_grad_enabled()) or (cfg.aux_loss_coeff == 0 and cfg.z_loss_coeff == 0):
            return out_TH
        loss = cfg.aux_loss_coeff * plan.balance_loss + cfg.z_loss_coeff * plan.z_loss
        return AttachAuxLoss.apply(out_TH, loss, self.aux_loss_scale)

    @staticmethod
    def _stats(plan: RoutingPlan) -> MoEStats:
        return MoEStats(kept_per_expert=plan.kept_E.detach(), routed_per_expert=plan.routed_E.detach(),
                        dropped_fraction=plan.dropped_fraction.detach(), balance_loss=plan.balance_loss.detach(),
                        z_loss=plan.z_loss.detach(), capacity=plan.capacity)

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step from the load of the training forwards since the last
        call; call it after the optimizer step. (An expert-parallel layer will all-reduce the
        load over its data-parallel ranks first.)"""
        self.router.update_bias()
