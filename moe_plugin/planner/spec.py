"""What the planner is told: the model (``PlanModel``: the run's DeepSpeed JSON, its ``"moe"`` block parsed
by ``MoEConfig`` as a run parses it, and the model's ``ModelShape``), the planner's own knobs (``PlanOptions``),
the machine (``ClusterSpec``) and one candidate layout (``Layout``).

Every fact of the ``"moe"`` block (experts, top-k, capacity or dropless, which layers are MoE, the expert FFN
size and activation) is read from the parsed ``MoEConfig``; nothing here re-declares one of its defaults.
Shape, option and cluster JSONs are read as strictly as the ``"moe"`` block: unknown keys refused, a
``ConfigError`` naming the key path (``shape.hidden_size``), the value and what is valid. Units: bytes,
seconds, FLOP/s, bytes/s.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moe_plugin.configs.errors import MISSING, ConfigError, FieldProblem, from_validation_error
from moe_plugin.configs.schema import MoEConfig, load_ds_config

TOTAL = "train_batch_size"
MICRO_BATCHES = [1, 2, 4, 8]
# bytes per value by the run's precision: bf16 / fp16 (fp32 master weights and Adam m, v: 12) or fp32 (Adam m, v)
BYTES = {"half": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12, activation_bytes=2),
         "fp32": dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ModelShape(_Strict):
    """The model's shape in Megatron-LM's names (the example's flags: ``--num-layers`` sets ``num_layers``); what
    is left out as Megatron's ``TransformerConfig`` derives it."""

    num_layers: int = Field(..., ge=1, description="Transformer layers.")
    hidden_size: int = Field(..., ge=1, description="Hidden size H.")
    num_attention_heads: int = Field(..., ge=1, description="Attention heads.")
    ffn_hidden_size: Optional[int] = Field(None, ge=1, description="FFN size of the dense MLPs; default 4 x "
                                           "hidden_size.")
    num_query_groups: Optional[int] = Field(None, ge=1, description="Key/value heads (grouped-query attention); "
                                            "default num_attention_heads.")
    kv_channels: Optional[int] = Field(None, ge=1, description="Size of one head; default hidden_size / "
                                       "num_attention_heads.")
    vocab_size: int = Field(..., ge=1, description="Vocabulary size V (padded).")
    seq_length: int = Field(..., ge=1, description="Sequence length S.")

    @model_validator(mode="after")
    def _check(self) -> "ModelShape":
        heads = self.num_attention_heads
        if self.kv_channels is None and self.hidden_size % heads:
            raise FieldProblem("num_attention_heads", heads, f"must divide hidden_size ({self.hidden_size}), or "
                               "set kv_channels")
        if heads % self.query_groups:
            raise FieldProblem("num_query_groups", self.num_query_groups, f"must divide num_attention_heads ({heads})")
        return self

    @property
    def ffn(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def query_width(self) -> int:
        """q: the queries' width (hidden_size without kv_channels)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """kv: the keys' (and the values') width (hidden_size without grouped-query attention)."""
        return self.query_groups * self.head_dim

    def transformer_fields(self) -> dict:
        """The ``TransformerConfig`` fields this shape sets."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                 "kv_channels")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @classmethod
    def load(cls, source: Union[dict, str, os.PathLike]) -> "ModelShape":
        return _load(cls, source, "shape")


class PlanOptions(_Strict):
    """The planner's own knobs; ``of`` fills what is not given (``MICRO_BATCHES``, ``BYTES``)."""

    micro_batches: list[int] = Field(..., description="Micro-batch sizes (sequences per rank) to try.")
    param_bytes: int = Field(..., ge=1, description="Bytes of a parameter as computed with (2: bf16/fp16, 4: fp32).")
    grad_bytes: int = Field(..., ge=1, description="Bytes of a gradient.")
    optimizer_bytes: int = Field(..., ge=0, description="Optimizer bytes per parameter (12: fp32 master + Adam "
                                 "m, v under mixed precision; 8: Adam m, v in fp32 training).")
    activation_bytes: int = Field(..., ge=1, description="Bytes of an activation value.")

    @model_validator(mode="after")
    def _check(self) -> "PlanOptions":
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise FieldProblem("micro_batches", self.micro_batches, "expected a non-empty list of integers >= 1")
        return self

    @classmethod
    def of(cls, ds_config: dict, given: Optional[dict] = None) -> "PlanOptions":
        """``given`` over the defaults: ``MICRO_BATCHES`` and the ``BYTES`` of the run's precision."""
        defaults = {"micro_batches": MICRO_BATCHES, **BYTES["half" if half_precision(ds_config) else "fp32"]}
        return _load(cls, {**defaults, **(given or {})}, "options")


def half_precision(ds_config: dict) -> bool:
    """Whether the run trains in bf16 or fp16 (DeepSpeed's keys, as ``moe_plugin.initialize`` reads them)."""
    return any(isinstance(ds_config.get(k), dict) and ds_config[k].get("enabled", False)
               for k in ("fp16", "bf16", "bfloat16"))


@dataclass(frozen=True)
class PlanModel:
    """A GPT-MoE as its run describes it: the DeepSpeed JSON (the global batch, the precision, the ``"moe"``
    block), the shape and the planner's options. Candidates are this JSON under their layouts (``ds_config``)."""

    ds_config: dict
    moe: MoEConfig
    shape: ModelShape
    options: PlanOptions

    @classmethod
    def build(cls, ds_config: Union[dict, str, os.PathLike], shape: Union[ModelShape, dict, str, os.PathLike],
              options: Optional[dict] = None) -> "PlanModel":
        """Read and check everything (``ConfigError`` naming the key): the JSON as ``deepspeed.initialize`` reads
        it, its ``"moe"`` block by ``MoEConfig.from_ds_config`` against the shape's depth, as a run does."""
        ds = load_ds_config(ds_config)
        moe = MoEConfig.from_ds_config(ds)
        shape = shape if isinstance(shape, ModelShape) else ModelShape.load(shape)
        moe.check_num_layers(shape.num_layers, "shape.num_layers")
        total = ds.get(TOTAL, MISSING)
        if total is MISSING or isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ConfigError(TOTAL, total, "expected an integer >= 1: the planner keeps the run's global batch and "
                              "chooses its split (train_micro_batch_size_per_gpu, gradient_accumulation_steps)")
        if moe.shared_expert_ffn_hidden_size:
            raise ConfigError("moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, "the planner "
                              "does not price shared experts (docs/planner.md, Not modelled); plan without them")
        return cls(ds, moe, shape, PlanOptions.of(ds, options))

    @property
    def global_batch(self) -> int:
        return self.ds_config[TOTAL]

    @property
    def expert_ffn(self) -> int:
        """F_e: the ``"moe"`` block's ``ffn_hidden_size``, else the model's."""
        return self.moe.ffn_hidden_size or self.shape.ffn

    @property
    def expert_width(self) -> int:
        """F1, the first expert GEMM's width: 2 F_e for a gated activation (GLU), else F_e."""
        from moe_plugin.layers.experts import GATED

        return 2 * self.expert_ffn if self.moe.activation in GATED else self.expert_ffn

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.shape.num_layers) if self.moe.is_moe_layer(i)]

    def dense_layer_params(self) -> int:
        """Attention (QKV + projection, biases) and the two LayerNorms of one layer."""
        h, q, kv = self.shape.hidden_size, self.shape.query_width, self.shape.kv_width
        return h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 4 * h

    def mlp_params(self) -> int:
        return 2 * self.shape.hidden_size * self.shape.ffn + self.shape.ffn + self.shape.hidden_size

    def expert_params(self) -> int:
        """One expert: its two weight matrices (and biases with ``expert_linear_bias``), as the grouped experts."""
        h, f1, f = self.shape.hidden_size, self.expert_width, self.expert_ffn
        return h * f1 + f * h + (f1 + h if self.moe.expert_linear_bias else 0)

    def embedding_params(self) -> int:
        return (self.shape.vocab_size + self.shape.seq_length) * self.shape.hidden_size

    def total_params(self) -> int:
        L, H, E = self.shape.num_layers, self.shape.hidden_size, self.moe.num_experts
        moe = len(self.moe_layers)
        return (L * self.dense_layer_params() + (L - moe) * self.mlp_params()
                + moe * (E * self.expert_params() + H * E) + self.embedding_params() + self.shape.vocab_size * H)


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
