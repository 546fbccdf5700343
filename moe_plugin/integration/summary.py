"""What ``initialize`` built, in numbers: ``run.summary`` (``RunSummary``), printed on rank 0 (collective).

``sizes``, ``moe_layers`` (global indices), ``experts_per_rank``, ``parameters`` (``total``, ``expert``, ``dense``,
``active`` per token; each distinct parameter once), ``memory_per_rank_mb`` (``memory_estimate.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from moe_plugin.configs.schema import MoEConfig
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.integration.grad_norm import distinct_parameter_count
from moe_plugin.integration.memory_estimate import SAVED_BYTES, estimate, local_counts, model_shape, reduce_bucket
from moe_plugin.layers.experts import GroupedExperts

SMALL_BUCKET = int(5e7)   # the reduce bucket a refusal proposes (its label says 5e7)
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
            f"moe_plugin: memory per rank (estimate, busiest rank, {self.dtype}, ZeRO stage {self.zero_stage}): "
            f"peak {m['total']:,.0f} MiB = weights {m['weights']:,.0f} + optimizer {m['optimizer']:,.0f} + gradients "
            f"{m['grads']:,.0f} + buffers {m['buffers']:,.0f} + activations {m['activations']:,.0f} + runtime "
            f"{m['runtime']:,.0f}; {m['steady']:,.0f} between steps"
            + (f"; {m['available']:,.0f} MiB available" if m.get("available") is not None else "")
            + f"; an asynchronous save copies {m['async_save_copy']:,.0f} MiB more to host memory"])


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory estimate reads beyond the model, taken when ``initialize`` started."""

    ds_config: dict = dataclasses.field(default_factory=dict)
    micro_batch: int = 1
    args: Any = None
    runtime_bytes: float = 0.0
    available_bytes: Optional[float] = None


def run_summary(model: nn.Module, moe_config: MoEConfig, groups: ProcessGroups, zero_stage: int,
                dtype: str = "fp32", memory: Optional[MemoryInputs] = None) -> RunSummary:
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
        memory_per_rank_mb=_memory_estimate(model, params, moe_config, sizes, zero_stage, dtype, memory))


def _moe_layers(model: nn.Module) -> list:
    """Global indices of the MoE layers over all ranks (a bare ``MoELayer``: its position on its rank)."""
    from moe_plugin.layers.moe_layer import MoELayer

    mine = [getattr(m, "layer_index", i) for i, m in enumerate(x for x in model.modules() if isinstance(x, MoELayer))]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return sorted(set(mine))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({i for rank_layers in every for i in rank_layers})


def _memory_estimate(model: nn.Module, params: list, moe_config: MoEConfig, sizes: Any, zero_stage: int,
                     dtype: str, memory: Optional["MemoryInputs"]) -> dict:
    """MiB of each part on the busiest rank, and the copies a save makes (collective)."""
    memory = memory or MemoryInputs()
    counts = local_counts(params)
    layer_experts = max((m.weight1.numel() + m.weight2.numel() for m in model.modules()
                         if isinstance(m, GroupedExperts)), default=0)
    shape = model_shape(model, moe_config, sizes, memory.micro_batch, memory.args)

    def total(stage: int, ds_config: dict) -> dict:
        return estimate(counts, sizes, stage, dtype, ds_config, shape, memory.runtime_bytes, layer_experts)

    mine = total(zero_stage, memory.ds_config)
    alternatives = {}
    if zero_stage == 1:
        alternatives["ZeRO stage 2"] = total(2, memory.ds_config)["total"]
    if zero_stage >= 1 and reduce_bucket(memory.ds_config) > SMALL_BUCKET:
        small = dict(memory.ds_config, zero_optimization={**(memory.ds_config.get("zero_optimization") or {}),
                                                          "reduce_bucket_size": SMALL_BUCKET})
        alternatives["zero_optimization.reduce_bucket_size 5e7"] = total(zero_stage, small)["total"]
    mine["alternatives"] = {k: v for k, v in alternatives.items() if v < mine["total"]}
    dense, expert = counts
    copy = (dense + expert * sizes.etp) * SAVED_BYTES
    every = [(mine, copy, memory.available_bytes)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, copy, memory.available_bytes))
    mine = max((m for m, _, _ in every), key=lambda m: m["total"])   # the busiest rank
    copy = max(c for _, c, _ in every)
    known = [a for _, _, a in every if a is not None]
    available = min(known) if known else None   # the rank with the least memory
    result = {k: round(v, 3) for k, v in mine.items() if k != "alternatives"}
    result["async_save_copy"] = round(copy / _MB, 3)
    result["with_async_save"] = round(result["total"] + copy / _MB, 3)
    result["available"] = None if available is None else round(available / _MB, 3)
    result["alternatives"] = {k: round(v, 3) for k, v in mine["alternatives"].items()}
    return result
