"""What the planner is told: the model (``ModelSpec``), the machine (``ClusterSpec``) and one candidate
layout (``Layout``).

Model and cluster JSONs are read as strictly as the ``"moe"`` block: unknown keys refused, a ``ConfigError``
naming the key path (``model.hidden``), the value and what is valid. Units: bytes, seconds, FLOP/s, bytes/s.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moe_plugin.configs.errors import ConfigError, FieldProblem, from_validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """A GPT-MoE and its global batch. Layer i (0-based) is MoE when ``i % moe_layer_interval == 0``."""

    layers: int = Field(..., ge=1, description="Transformer layers.")
    hidden: int = Field(..., ge=1, description="Hidden size H.")
    ffn: int = Field(..., ge=1, description="FFN size of the dense MLPs.")
    heads: int = Field(..., ge=1, description="Attention heads.")
    vocab: int = Field(..., ge=1, description="Vocabulary size V.")
    seq: int = Field(..., ge=1, description="Sequence length S.")
    experts: int = Field(..., ge=1, description="Experts per MoE layer E.")
    top_k: int = Field(2, ge=1, description="Experts per token k.")
    capacity_factor: Optional[float] = Field(1.25, gt=0, description="Capacity as a multiple of the even share; "
                                             "null: dropless.")
    moe_layer_interval: int = Field(1, ge=1, description="Layer i is MoE when i % interval == 0.")
    expert_ffn: Optional[int] = Field(None, ge=1, description="FFN size of one expert; default: ffn.")
    global_batch: int = Field(..., ge=1, description="Sequences per optimizer step, all replicas together.")
    micro_batches: list[int] = Field([1, 2, 4, 8], description="Micro-batch sizes (sequences per rank) to try.")
    param_bytes: int = Field(2, ge=1, description="Bytes of a parameter as computed with (2: bf16/fp16, 4: fp32).")
    grad_bytes: int = Field(2, ge=1, description="Bytes of a gradient.")
    optimizer_bytes: int = Field(12, ge=0, description="Optimizer bytes per parameter (12: fp32 master + Adam "
                                 "m, v under mixed precision; 8: Adam m, v in fp32 training).")
    activation_bytes: int = Field(2, ge=1, description="Bytes of an activation value.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.hidden % self.heads:
            raise FieldProblem("heads", self.heads, f"must divide hidden ({self.hidden})")
        if self.top_k > self.experts:
            raise FieldProblem("top_k", self.top_k, f"must be at most experts ({self.experts})")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise FieldProblem("micro_batches", self.micro_batches, "expected a non-empty list of integers >= 1")
        return self

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_ffn if self.expert_ffn is not None else self.ffn

    def is_moe(self, layer: int) -> bool:
        return layer % self.moe_layer_interval == 0

    def dense_layer_params(self) -> int:
        """Attention (QKV + projection, biases) and the two LayerNorms of one layer."""
        h = self.hidden
        return 4 * h * h + 4 * h + 4 * h

    def mlp_params(self) -> int:
        return 2 * self.hidden * self.ffn + self.ffn + self.hidden

    def expert_params(self) -> int:
        """One expert (two weight matrices, no biases, as the plugin's grouped experts)."""
        return 2 * self.hidden * self.expert_ffn_size

    def embedding_params(self) -> int:
        return (self.vocab + self.seq) * self.hidden

    def total_params(self) -> int:
        moe = sum(self.is_moe(i) for i in range(self.layers))
        return (self.layers * self.dense_layer_params() + (self.layers - moe) * self.mlp_params()
                + moe * (self.experts * self.expert_params() + self.hidden * self.experts)
                + self.embedding_params() + self.vocab * self.hidden)

    @classmethod
    def load(cls, source: Union[dict, str, os.PathLike]) -> "ModelSpec":
        return _load(cls, source, "model")


class ClusterSpec(_Strict):
    """Devices and links. ``calibrate.py`` writes one of these, measured."""

    name: str = Field("cluster", description="A label for tables and plots.")
    nodes: int = Field(..., ge=1, description="Nodes.")
    gpus_per_node: int = Field(..., ge=1, description="Devices (ranks) per node.")
    flops: float = Field(..., gt=0, description="Peak FLOP/s of one device in the training dtype.")
    gemm_efficiency: list[list[float]] = Field([[1e12, 0.6]], description="[[gemm_flops, fraction_of_peak], ...] "
                                               "points, increasing in gemm_flops.")
    memory: float = Field(..., gt=0, description="Bytes of memory per device.")
    memory_usable: float = Field(0.9, gt=0, le=1, description="Fraction of memory the planner may fill.")
    intra_bandwidth: float = Field(..., gt=0, description="Bytes/s one rank sends inside a node (NVLink).")
    inter_bandwidth: float = Field(..., gt=0, description="Bytes/s one rank sends across nodes (its NIC share).")
    intra_latency: float = Field(5e-6, ge=0, description="Seconds per message inside a node.")
    inter_latency: float = Field(2e-5, ge=0, description="Seconds per message across nodes.")
    optimizer_rate: float = Field(5e9, gt=0, description="Parameters per second one device updates (Adam).")
    allreduce_bandwidth: Optional[float] = Field(None, gt=0, description="Bytes/s of one step of a ring "
                                                 "all-reduce / all-gather / reduce-scatter inside a node; null: "
                                                 "intra_bandwidth (NCCL rings run at the link's speed).")
    allreduce_latency: Optional[float] = Field(None, ge=0, description="Seconds per ring step of those "
                                               "collectives inside a node; null: intra_latency.")
    layer_overhead: float = Field(1e-4, ge=0, description="Seconds of fixed cost (launches, framework) per "
                                  "transformer layer and micro-batch, forward and backward together.")
    layer_element_time: float = Field(3e-11, ge=0, description="Seconds per activation element (tokens x hidden) "
                                      "of a layer's non-GEMM work (norms, softmax, activation, residuals, "
                                      "copies), forward and backward.")
    logit_element_time: float = Field(1e-11, ge=0, description="Seconds per logit (tokens x vocab / tp) of the "
                                      "LM head's and the loss's non-GEMM work (softmax, cross entropy, the "
                                      "embedding's gradient), forward and backward.")
    moe_layer_overhead: float = Field(2e-4, ge=0, description="Seconds of fixed cost of an MoE layer's routing "
                                      "and dispatch (gate, top-k, sort, permutation, launches) per micro-batch, "
                                      "forward and backward, beyond its GEMMs and collectives.")
    moe_element_time: float = Field(3e-11, ge=0, description="Seconds per routed element (row x hidden: rows a "
                                    "rank sends plus rows it receives) of the MoE layer's gathers, scatters "
                                    "and expert activation, forward and backward.")
    oversubscription: float = Field(1.0, ge=1, description="Ranks per compute unit the rates were measured "
                                    "with (ranks / cores of a CPU job; 1 on GPUs): a phase where only 1/pp of "
                                    "the ranks compute (the pipeline bubble) runs up to this much faster.")
    step_overhead: float = Field(5e-3, ge=0, description="Seconds of fixed cost per optimizer step (the "
                                 "engine's step: hooks, norms, bookkeeping) when zero_step_overhead is null.")
    zero_step_overhead: Optional[list[float]] = Field(None, description="[stage 0, 1, 2] fixed seconds per "
                                                      "optimizer step under each ZeRO stage; null: step_overhead.")
    zero_param_time: list[float] = Field([2e-11, 2e-11, 2e-11], description="[stage 0, 1, 2] seconds per "
                                         "parameter a rank holds of the engine's per-parameter bookkeeping "
                                         "(gradient copies and flattening, norms, parameter updates) beyond "
                                         "the Adam step and the gradient reduction.")

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        points = self.gemm_efficiency
        if not points or any(len(p) != 2 or p[0] <= 0 or not 0 < p[1] <= 1 for p in points):
            raise FieldProblem("gemm_efficiency", points, "expected [[gemm_flops > 0, fraction in (0, 1]], ...]")
        if any(a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise FieldProblem("gemm_efficiency", points, "points must increase in gemm_flops")
        for key in ("zero_step_overhead", "zero_param_time"):
            values = getattr(self, key)
            if values is not None and (len(values) != 3 or min(values) < 0):
                raise FieldProblem(key, values, "expected [stage_0, stage_1, stage_2] seconds, each >= 0")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def efficiency(self, gemm_flops: float) -> float:
        """Fraction of peak a GEMM of ``gemm_flops`` reaches: log-linear between the points."""
        pts = self.gemm_efficiency
        if gemm_flops <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if gemm_flops <= x1:
                t = (math.log(gemm_flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + t * (y1 - y0)
        return pts[-1][1]

    def gemm_time(self, gemm_flops: float, count: float = 1.0) -> float:
        """Seconds for ``count`` GEMMs of ``gemm_flops`` each."""
        if gemm_flops <= 0 or count <= 0:
            return 0.0
        return count * gemm_flops / (self.flops * self.efficiency(gemm_flops))

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose ranks lie within ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def ring_link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of one step of a ring all-reduce / all-gather / reduce-scatter."""
        if span <= self.gpus_per_node:
            return (self.allreduce_bandwidth or self.intra_bandwidth,
                    self.intra_latency if self.allreduce_latency is None else self.allreduce_latency)
        return self.inter_bandwidth, self.inter_latency

    def engine_step(self, zero: int) -> tuple[float, float]:
        """(fixed seconds per optimizer step, seconds per parameter held) of the engine under ZeRO ``zero``."""
        fixed = self.step_overhead if self.zero_step_overhead is None else self.zero_step_overhead[min(zero, 2)]
        return fixed, self.zero_param_time[min(zero, 2)]

    @classmethod
    def load(cls, source: Union[dict, str, os.PathLike]) -> "ClusterSpec":
        return _load(cls, source, "cluster")


@dataclass(frozen=True)
class Layout:
    """One candidate: parallel sizes, ZeRO stage and batch split (``dp * micro_batch * gas`` = the global batch)."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    zero: int
    micro_batch: int
    gas: int
    order: str = "tp-cp-ep-dp-pp"

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)

    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if v > 1]
        if self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        parts.append(f"dp{self.dp}")
        return "-".join(parts) + f"/z{self.zero}/mb{self.micro_batch}x{self.gas}"


def _load(cls: type[_Strict], source: Union[dict, str, os.PathLike], root: str) -> Any:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"{root} file", str(path), f"cannot be read ({err.strerror}); expected the "
                              f"path of a {root} JSON file") from None
        try:
            source = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{root} file {path}", text, "expected a JSON object", shown=f"invalid JSON "
                              f"at line {err.lineno} column {err.colno} ({err.msg})") from None
    if not isinstance(source, dict):
        raise ConfigError(root, source, f"expected a JSON object with the {root} fields")
    try:
        return cls.model_validate(source)
    except ValidationError as err:
        raise from_validation_error(err, cls, root) from None
