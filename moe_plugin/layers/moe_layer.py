"""MoELayer: route -> dispatch -> experts -> combine (+ shared expert), the four steps of ``forward``,
under any parallel layout (``parallel.py``); it replaces a Megatron MLP. The router runs in fp32, the
experts and the output in the input dtype; the balance and z losses reach the gradients through
``AttachAuxLoss``. Shape suffixes: see ``moe_plugin.layers``; the path: docs/moe_layer.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from moe_plugin.configs.schema import MoEConfig
from moe_plugin.layers import comm
from moe_plugin.layers.balance import BalanceScope
from moe_plugin.layers.exchange_factory import build_dispatcher
from moe_plugin.layers.experts import GroupedExperts, SharedExpert
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.router import Router, RouterNoise, RoutingPlan
from moe_plugin.layers.shadow import ShadowExperts
from moe_plugin.layers.wire import Dispatch

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also gives ``loss`` the gradient ``scale``, so ``d(scale * loss)``
    joins the parameter gradients whenever anything downstream of ``out`` is backpropagated."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.loss_meta = scale, (loss.dtype, loss.device)
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
    traffic_PE: Optional[Tensor] = None  # [P, E] kept routes of each EP peer's tokens per expert
                                         # (the same on every EP peer; None without EP)


def reduce_stats(stats: MoEStats, group: comm.Group) -> MoEStats:
    """``stats`` of every rank of ``group`` (each with distinct tokens) in one all-reduce: counts summed,
    losses averaged, the dropped fraction recomputed (the traffic is already agreed over EP)."""
    if group is None:
        return stats
    E = stats.kept_per_expert.numel()
    packed = torch.cat([stats.kept_per_expert.double(), stats.routed_per_expert.double(),
                        torch.stack([stats.balance_loss, stats.z_loss]).double()])
    dist.all_reduce(packed, group=group)
    kept, routed = packed[:E].round().long(), packed[E:2 * E].round().long()
    n = comm.group_size(group)
    routed_total = routed.sum()
    return MoEStats(kept_per_expert=kept, routed_per_expert=routed,
                    dropped_fraction=((routed_total - kept.sum()).float() / routed_total.clamp(min=1).float()),
                    balance_loss=(packed[2 * E] / n).float(), z_loss=(packed[2 * E + 1] / n).float(),
                    capacity=stats.capacity, traffic_PE=stats.traffic_PE)


class StatsSum:
    """The ``MoEStats`` of several forwards of one layer added up on the device (no host sync): what a
    logger or a load tracker keeps between its reads of ``last_stats``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.kept = self.routed = self.traffic = None   # [E], [E], [P, E] (None without EP): summed counts
        self.balance = self.z = None                    # fp64 sums of the losses
        self.forwards, self.capacity = 0, None

    def add(self, stats: MoEStats) -> None:
        if self.forwards == 0:
            self.kept, self.routed = stats.kept_per_expert.long().clone(), stats.routed_per_expert.long().clone()
            self.traffic = None if stats.traffic_PE is None else stats.traffic_PE.long().clone()
            self.balance, self.z = stats.balance_loss.double().clone(), stats.z_loss.double().clone()
        else:
            self.kept += stats.kept_per_expert
            self.routed += stats.routed_per_expert
            if self.traffic is not None:             # a forward without it (padded exchange): no sum
                self.traffic = None if stats.traffic_PE is None else self.traffic.add_(stats.traffic_PE)
            self.balance += stats.balance_loss
            self.z += stats.z_loss
        self.forwards += 1
        self.capacity = stats.capacity

    def as_stats(self) -> MoEStats:
        """The sums as one ``MoEStats`` (losses averaged; the dropped fraction left to ``reduce_stats``)."""
        return MoEStats(kept_per_expert=self.kept, routed_per_expert=self.routed, dropped_fraction=torch.zeros(()),
                        balance_loss=(self.balance / self.forwards).float(), z_loss=(self.z / self.forwards).float(),
                        capacity=self.capacity, traffic_PE=self.traffic)


def _check_sizes(config: MoEConfig, parallel: LayerParallelism) -> None:
    """The config's parallel block must describe the groups the layer receives."""
    p = config.parallel
    for key, mine, theirs in (("tensor", p.tensor, parallel.tp_size), ("expert", p.expert, parallel.ep_size),
                              ("expert_tensor", p.etp, parallel.etp_size)):
        if mine != theirs:
            raise ValueError(f"moe.parallel.{key} is {mine} but the process groups given to the MoE layer "
                             f"have size {theirs}; build the groups from the same config")


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP (module docstring). ``seed`` makes the init deterministic and layout
    independent; ``placement`` [E]: the slot of every expert (default: expert e in slot e)."""

    def __init__(self, config: MoEConfig, hidden_size: int, ffn_hidden_size: int,
                 groups: Optional["ProcessGroups"] = None, *,
                 seed: int = 0, init_std: float = 0.02, output_init_std: Optional[float] = None,
                 placement: Optional[Tensor] = None):
        super().__init__()
        self.config = config
        self.groups = groups
        self.hidden_size = hidden_size
        ffn = config.ffn_hidden_size or ffn_hidden_size
        self.parallel = p = LayerParallelism.from_groups(groups, config.parallel.sequence_parallel)
        if groups is not None:
            _check_sizes(config, p)
        self.router = Router(config, hidden_size, seed=seed, init_std=init_std, noise_index=p.dp_rank,
                             grad_group=p.dense_grad_group, check_group=None if p.ep_is_tokens else p.tokens,
                             share_group=p.tp)
        self.balance = BalanceScope(config.aux_loss_scope, p)
        self.experts = GroupedExperts(config.num_experts, hidden_size, ffn, config.activation, placement=placement,
                                      ep_size=p.ep_size, ep_rank=p.ep_rank, etp_size=p.etp_size, etp_rank=p.etp_rank,
                                      group_name=p.expert_group_name, seed=seed, init_std=init_std,
                                      output_init_std=output_init_std, grad_scale=p.expert_grad_scale,
                                      recompute_pre_activation=config.recompute_fc1, backend=config.experts_backend,
                                      bias=config.expert_linear_bias, alpha=config.swiglu_alpha,
                                      limit=config.swiglu_limit)
        self.shadow = ShadowExperts(self.experts, p.ep)
        self.traffic_reader: Optional[str] = None      # what reads the sender x expert traffic (``track_traffic``)
        self.dispatcher, self.exchange = build_dispatcher(config, p, self.shadow)   # exchange: counts | padded | token
        self.shared_expert = None
        if config.shared_expert_ffn_hidden_size > 0:
            self.shared_expert = SharedExpert(hidden_size, config.shared_expert_ffn_hidden_size, config.activation,
                                              gate=config.shared_expert_gate, seed=seed, init_std=init_std,
                                              output_init_std=output_init_std, grad_group=p.dense_grad_group,
                                              alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        # Multiplies the aux-loss gradient: set it to the main loss's scale (gradient
        # accumulation, fp16 loss scaling) so both gradients are scaled alike.
        self.aux_loss_scale = 1.0
        self.last_stats: Optional[MoEStats] = None

    def forward(self, hidden_SBH: Tensor, noise: Optional[RouterNoise] = None,
                document_T: Optional[Tensor] = None) -> tuple[Tensor, None]:
        """Route, dispatch, experts, combine ``hidden_SBH`` [S, B, H] (under SP this rank's share);
        ``noise``: given random numbers; ``document_T`` [T]: each row's document, -1 padding."""
        if hidden_SBH.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE layer input has hidden size {hidden_SBH.shape[-1]}, expected {self.hidden_size}")
        x_TH, whole_T, real_T = self._tokens(hidden_SBH, document_T)
        # Profiler scopes (``record_function``, a few microseconds each): the parts of ``bench step --parts``.
        with record_function("moe.router"):                                            # 1. route
            balance = self.balance.loss_for(hidden_SBH.shape[1] if hidden_SBH.dim() == 3 else None, self.training,
                                            whole_T)
            plan, finite = self.router(x_TH, noise, self.placement, balance, None if whole_T is None else whole_T >= 0)
        with record_function("moe.dispatch"):                                          # 2. dispatch
            batch = self.dispatcher.prepare(x_TH, plan, finite)        # the one host sync; the kept routes
            self.router.record_load(plan)
        rows = self.dispatcher.dispatch(batch)
        scopes, shared_TH = self.dispatcher.schedule.scopes, None
        if self.shared_expert is not None and self.dispatcher.schedule.overlaps_shared:
            with record_function(scopes.shared_expert):                  # while the rows cross
                shared_TH = self.shared_expert(batch.x_TH)
        y = self.dispatcher.experts(rows, batch, self.experts)                         # 3. experts
        out_TH = self.dispatcher.combine(y, batch)                                     # 4. combine
        if self.shared_expert is not None:
            with record_function(scopes.shared_expert):
                out_TH = out_TH + (shared_TH if shared_TH is not None else self.shared_expert(batch.x_TH))
        if real_T is not None and self.shared_expert is not None:   # the routed experts gave padding nothing
            out_TH = torch.where(real_T[:, None], out_TH, 0.0)
        out_TH = self._attach_losses(out_TH, plan)
        self.last_stats = self._stats(plan, batch)
        if self.parallel.splits_input:
            out_TH = comm.gather_tokens(out_TH, self.parallel.tp)
        return out_TH.view(hidden_SBH.shape), None

    def _tokens(self, hidden_SBH: Tensor, document_T: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor],
                                                                                 Optional[Tensor]]:
        """(my rows [T, H], padding zeroed; the replica's documents, all TP shares; my real rows)."""
        p = self.parallel
        x_TH = hidden_SBH.reshape(-1, self.hidden_size)
        whole_T = real_T = None
        if document_T is not None:
            whole_T, mine_T = self._documents(document_T, x_TH)
            real_T = mine_T >= 0
        if p.splits_input:
            x_TH = comm.split_tokens(x_TH, p.tp)
        if real_T is not None:
            x_TH = torch.where(real_T[:, None], x_TH, 0.0)
        return x_TH, whole_T, real_T

    def _documents(self, document_T: Tensor, x_TH: Tensor) -> tuple[Tensor, Tensor]:
        """(the replica's documents, all TP shares; those of the rows this rank routes)."""
        if document_T.shape != (x_TH.shape[0],) or document_T.is_floating_point() or document_T.dtype == torch.bool:
            raise ValueError(f"MoE layer document_T must be integer document ids [{x_TH.shape[0]}] (one per input "
                             f"row, -1 for padding); got {document_T.dtype} {list(document_T.shape)}")
        ids_T = document_T.to(device=x_TH.device, dtype=torch.long)
        p = self.parallel
        if p.tp_size == 1:
            return ids_T, ids_T
        if p.splits_input:
            return ids_T, comm.split_tokens(ids_T, p.tp)
        return comm.gather_tokens(ids_T, p.tp), ids_T

    def set_shadow(self, expert_ids) -> None:
        """Shadow these experts (global ids; ``[]``: none), on every EP rank alike, between steps; the
        dispatcher is built again (what does not combine raises, nothing changed)."""
        before = self.shadow.expert_ids
        self.shadow.set(expert_ids)
        try:
            self.dispatcher, self.exchange = build_dispatcher(self.config, self.parallel, self.shadow,
                                                              self.traffic_reader)
        except ValueError:
            self.shadow.set(before)
            raise

    def track_traffic(self, what: str) -> None:
        """``what`` (a load tracker) reads the sender x expert traffic: the dispatcher is built again."""
        self.dispatcher, self.exchange = build_dispatcher(self.config, self.parallel, self.shadow, what)
        self.traffic_reader = what

    def shadowed_experts(self) -> list[int]:
        """Global ids of the shadowed experts, ascending."""
        return list(self.shadow.expert_ids)

    @property
    def placement(self) -> Tensor:
        """[E] the slot of every expert (``experts.placement``)."""
        return self.experts.placement

    def local_experts(self) -> list[int]:
        """Global ids of the experts in this rank's slots, in slot order."""
        return self.experts.local_ids()

    def _attach_losses(self, out_TH: Tensor, plan: RoutingPlan) -> Tensor:
        cfg = self.config
        if not (self.training and torch.is_grad_enabled()) or (cfg.aux_loss_coeff == 0 and cfg.z_loss_coeff == 0):
            return out_TH
        loss = cfg.aux_loss_coeff * plan.balance_loss + cfg.z_loss_coeff * plan.z_loss
        return AttachAuxLoss.apply(out_TH, loss, self.aux_loss_scale)

    def _stats(self, plan: RoutingPlan, state: Dispatch) -> MoEStats:
        traffic_PD = state.traffic_PD
        traffic_PE = None if traffic_PD is None or self.parallel.ep is None else traffic_PD[:, self.placement]
        return MoEStats(kept_per_expert=plan.kept_E.detach(), routed_per_expert=plan.routed_E.detach(),
                        dropped_fraction=plan.dropped_fraction.detach(), balance_loss=plan.balance_loss.detach(),
                        z_loss=plan.z_loss.detach(), capacity=state.plan.capacity, traffic_PE=traffic_PE)

    def global_stats(self) -> Optional[MoEStats]:
        """``last_stats`` reduced over the ranks that route distinct tokens (``tp_dp``): collective."""
        if self.last_stats is None:
            return None
        return reduce_stats(self.last_stats, self.parallel.tokens)

    def reset_balance_counts(self) -> None:
        """A new optimizer step starts (``aux_loss_scope`` global; ``moe_plugin.initialize`` calls it)."""
        self.balance.reset()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step from the training forwards' load, summed over the ranks that route
        distinct tokens (collective, after the optimizer step; ``moe_plugin.initialize`` calls it)."""
        load_E = self.router.load_E.clone()
        if self.parallel.tokens is not None:
            dist.all_reduce(load_E, group=self.parallel.tokens)
        self.router.update_bias(load_E)


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """This rank's MoE layers by module name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
