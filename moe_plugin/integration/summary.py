"""What ``initialize`` built, in numbers: ``run.summary`` (``RunSummary``), printed on rank 0.

    run = moe_plugin.initialize(ds_config, model_provider)
    run.summary.experts_per_rank, run.summary.parameters["active"], run.summary.to_dict()

* ``sizes``: the layout's group sizes (tp, pp, dp, ep, etp, edp; world size and order).
* ``moe_layers``: global 0-based indices of the MoE layers (over all pipeline stages);
  ``experts_per_rank``: experts each rank hosts in each MoE layer (``num_experts / ep``; each
  of them split over etp ranks).
* ``parameters``: the whole model's, each distinct parameter once over all ranks
  (``grad_norm.distinct_parameter_count``): ``total``, ``expert`` (the MoE layers' experts),
  ``dense`` (the rest: attention, embeddings, routers, dense MLPs) and ``active`` (per token:
  dense + the top-k of E experts of each MoE layer).
* ``memory_per_rank_mb``: an *estimate* for the busiest rank of its parameters, gradients and
  Adam state (``dtype``: 4 + 4 + 8 bytes per parameter in fp32; 2 + 2 + 12 in fp16/bf16 with fp32
  master weights), the optimizer state divided over dp (dense) and edp (experts) from ZeRO stage 1,
  the gradients too from stage 2. Activations, communication buffers and the framework are not in it.
  ``async_save_copy``: what an asynchronous save copies to host memory on the rank that writes the
  most (the checkpoint holds each trained value once with Adam's moments, 12 bytes per parameter:
  its experts whole over etp and the dense parameters it writes), beyond the estimate; a
  synchronous save holds one MoE layer's experts instead (docs/checkpoints.md).

Computing it is collective (every rank calls it, as ``initialize`` does).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from torch import nn

from moe_plugin.configs.schema import MoEConfig
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.integration.grad_norm import distinct_parameter_count

# bytes per parameter: (weight, gradient, optimizer state: Adam's two moments, + fp32 master copy)
BYTES = {"fp32": (4, 4, 8), "fp16": (2, 2, 12), "bf16": (2, 2, 12)}
SAVED_BYTES = 12   # a checkpoint's bytes per trained parameter: the value (or fp32 master) and Adam's two moments
_MB = 2 ** 20


@dataclass(frozen=True)
class RunSummary:
    sizes: dict
    moe_layers: list
    num_experts: int
    top_k: int
    experts_per_rank: int
    parameters: dict
    zero_stage: int
    dtype: str
    memory_per_rank_mb: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def text(self) -> str:
        """A few lines for the console."""
        s, p, m = self.sizes, self.parameters, self.memory_per_rank_mb
        grid = " x ".join(f"{k} {s[k]}" for k in ("tp", "pp", "dp", "ep", "etp", "edp"))
        moe = (f"MoE layers {self.moe_layers} of {self.num_experts} experts, top-{self.top_k}, "
               f"{self.experts_per_rank} experts per rank" if self.moe_layers else "no MoE layers (dense)")
        return "\n".join([
            f"moe_plugin: {s['world_size']} ranks: {grid} (order {s['order']})",
            f"moe_plugin: {moe}",
            f"moe_plugin: parameters {p['total']:,} = dense {p['dense']:,} + expert {p['expert']:,}; "
            f"active per token {p['active']:,}",
            f"moe_plugin: memory per rank (estimate, busiest rank: {self.dtype} weights, gradients and Adam state "
            f"under ZeRO stage {self.zero_stage}; no activations) {m['total']:,.1f} MiB = weights "
            f"{m['weights']:,.1f} + gradients {m['grads']:,.1f} + optimizer {m['optimizer']:,.1f}; an "
            f"asynchronous save copies up to {m['async_save_copy']:,.1f} MiB more to host memory"])


def run_summary(model: nn.Module, moe_config: MoEConfig, groups: ProcessGroups, zero_stage: int,
                dtype: str = "fp32") -> RunSummary:
    """The ``RunSummary`` of ``model`` (this rank's part) under ``groups`` (collective)."""
    sizes = groups.layout.sizes
    params = list(model.parameters())
    total, expert = distinct_parameter_count(params, groups)
    k, experts = moe_config.k, moe_config.num_experts
    layers = _moe_layers(model)
    counts = {"total": total, "dense": total - expert, "expert": expert,
              "active": total - expert + expert * k // experts}
    return RunSummary(
        sizes=sizes.model_dump(),
        moe_layers=layers, num_experts=experts, top_k=k, experts_per_rank=experts // sizes.ep if layers else 0,
        parameters=counts, zero_stage=zero_stage, dtype=dtype,
        memory_per_rank_mb=_memory_estimate(params, sizes, zero_stage, dtype, groups))


def _moe_layers(model: nn.Module) -> list:
    """Global indices of the MoE layers over all ranks (``layer_index`` of the plugin's Megatron
    MoE MLP; a bare ``MoELayer`` counts by its position on its rank)."""
    from moe_plugin.layers.moe_layer import MoELayer

    mine = [getattr(m, "layer_index", i) for i, m in enumerate(x for x in model.modules() if isinstance(x, MoELayer))]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return sorted(set(mine))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({i for rank_layers in every for i in rank_layers})


def _memory_estimate(params: list, sizes: Any, zero_stage: int, dtype: str,
                     groups: Optional[ProcessGroups]) -> dict:
    """MiB of weights, gradients and optimizer state on the busiest rank (collective)."""
    seen: set = set()
    dense = expert = 0
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if is_moe_param(p):
            expert += p.numel()
        else:
            dense += p.numel()
    w, g, o = BYTES[dtype]
    shard = dense / sizes.dp + expert / sizes.edp
    local = dense + expert
    mine = [(local if zero_stage < 2 else shard) * g, (local if zero_stage < 1 else shard) * o]
    mine = [local * w + sum(mine), local * w] + mine
    copy = (dense + expert * sizes.etp) * SAVED_BYTES
    if groups is not None and dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, copy))
        mine = max(m for m, _ in every)   # the busiest rank (by its total)
        copy = max(c for _, c in every)
    total, weights, grads, optimizer = (v / _MB for v in mine)
    return {"weights": round(weights, 3), "grads": round(grads, 3), "optimizer": round(optimizer, 3),
            "total": round(total, 3), "async_save_copy": round(copy / _MB, 3)}
