"""DeepSpeed's MoE layer set up to do the same work as a given ``MoELayer`` (the bench's rival).

``deepspeed_twin(ours)`` builds ``deepspeed.moe.layer.MoE`` with the same sizes, capacity rule and
weights as ``ours``: the gate weight is our router weight, expert e is
``Linear(H, F, bias=False) -> GELU -> Linear(F, H, bias=False)`` holding our ``weight1[e]`` and
``weight2[e]``. How the routing is made equivalent (DeepSpeed 0.19):

* top-2: ours is router ``gshard`` with ``second_expert_policy "all"`` (no random drop of the 2nd
  expert); DeepSpeed's ``top2gating`` with ``top2_2nd_expert_sampling=False`` (no Gumbel noise on
  the 2nd choice). Both pick the two largest logits, give buffer slots to all first choices before
  any second choice and earlier tokens before later ones, use ``C = ceil(cf * 2 * T / E)`` (at least
  ``min_capacity``) and the same balance loss ``E * sum_e f_e P_e``. They route identically; the one
  difference is that DeepSpeed renormalises a token's gates over its *kept* routes (a token whose
  2nd route is dropped gets gate 1 on its 1st), ours over its two chosen routes before capacity.
  ``use_rts`` (random token selection) only exists in DeepSpeed's top-1 gate.
* top-1: ours ``switch``; DeepSpeed's ``top1gating`` with ``use_rts=False``. Same choices and
  capacity; which tokens an over-full expert keeps is DeepSpeed's ``topk`` over a 0/1 mask (not
  strictly the earliest), and the gate is the raw softmax probability in both.
* k > 2: ours ``topk`` (gates renormalised); DeepSpeed's ``topkgating`` drops over-capacity routes by
  gate probability, not by position: same experts and capacity, different dropped routes.
* dropless: ours has no capacity; DeepSpeed sets ``C`` to the largest expert load and pads every
  expert's buffer to it.

With ``ep_size == 1`` DeepSpeed's layer makes no collective call, so no process group is needed.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_plugin.layers import MoELayer


def routing_fields(k: int, dropless: bool, capacity_factor: float) -> dict:
    """The routing fields of a ``"moe"`` block whose routing DeepSpeed's gates match (module
    docstring): k 1 ``switch``, k 2 ``gshard`` with ``second_expert_policy "all"``, other k ``topk``;
    ``capacity_factor`` in training and evaluation, left out when dropless (no capacity)."""
    router = {1: "switch", 2: "gshard"}.get(k, "topk")
    block: dict = {"router": router, "drop_tokens": not dropless}
    if router == "gshard":
        block["second_expert_policy"] = "all"
    if router == "topk":
        block["top_k"] = k
    if not dropless:
        block.update(capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor)
    return block


def deepspeed_twin(ours: MoELayer, ep_size: int = 1, set_parallelism: bool = True) -> nn.Module:
    """A ``deepspeed.moe.layer.MoE`` that routes like ``ours`` and holds copies of its weights.

    With ``ep_size > 1`` (every rank of the EP group calls it) it holds the same local experts as
    ``ours`` and its expert-parallel group is DeepSpeed's own ``ep_size_<n>`` over the world
    (``deepspeed.comm`` is initialised on top of the existing default group; see
    ``forget_deepspeed_groups``). ``set_parallelism=False`` leaves that to DeepSpeed's engine
    (``deepspeed.initialize`` calls ``set_deepspeed_parallelism``, which may run only once)."""
    from deepspeed.moe.layer import MoE

    cfg = ours.config
    if cfg.activation != "gelu" or ours.shared_expert is not None:
        raise ValueError(f"the DeepSpeed comparison needs a plain gelu expert (activation {cfg.activation!r}, "
                         f"shared expert {ours.shared_expert is not None})")
    if cfg.router == "gshard" and cfg.second_expert_policy != "all":
        raise ValueError("the DeepSpeed comparison needs second_expert_policy 'all' (DeepSpeed has no "
                         "GShard random routing of the 2nd expert)")
    weight1_LHF, weight2_LFH = ours.experts.weight1, ours.experts.weight2
    _, hidden, ffn = weight1_LHF.shape
    num_experts = cfg.num_experts
    expert = nn.Sequential(nn.Linear(hidden, ffn, bias=False), nn.GELU(), nn.Linear(ffn, hidden, bias=False))
    twin = MoE(hidden, expert, num_experts=num_experts, ep_size=ep_size, k=cfg.k,
               capacity_factor=cfg.capacity_factor, eval_capacity_factor=cfg.eval_capacity_factor,
               min_capacity=cfg.min_capacity, drop_tokens=cfg.drop_tokens, use_rts=False,
               top2_2nd_expert_sampling=False)
    with torch.no_grad():
        twin.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for l, mlp in enumerate(twin.deepspeed_moe.experts.deepspeed_experts):
            mlp[0].weight.copy_(weight1_LHF[l].t())
            mlp[2].weight.copy_(weight2_LFH[l].t())
    if ep_size > 1 and set_parallelism:
        import deepspeed

        backend = "gloo" if weight1_LHF.device.type == "cpu" else torch.distributed.get_backend()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        twin.set_deepspeed_parallelism()
        group = twin.deepspeed_moe.ep_group
        if group is None or torch.distributed.get_world_size(group) != ep_size:
            raise RuntimeError(f"DeepSpeed's expert-parallel group is not of size {ep_size}")
    return twin.to(weight1_LHF.device, weight1_LHF.dtype).train(ours.training)


def forget_deepspeed_groups(ep_size: int) -> None:
    """Remove DeepSpeed's ``ep_size_<n>`` groups from its registry (before the world is destroyed)."""
    from moe_plugin.compat.deepspeed_groups import forget_expert_groups

    forget_expert_groups(f"ep_size_{ep_size}")


def deepspeed_capacity(ours: MoELayer, num_tokens: int, routed_E: Tensor) -> int:
    """The per-expert buffer DeepSpeed pads every expert to, for ``num_tokens`` tokens whose routes
    per expert are ``routed_E``: our capacity when dropping, else the largest load."""
    capacity = ours.router.capacity(num_tokens)
    return int(routed_E.max()) if capacity is None else capacity
