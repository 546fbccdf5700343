"""The ``"moe"`` block of the DeepSpeed JSON (DeepSpeed ignores top-level keys it does not know).

    {"train_batch_size": 32, "moe": {"num_experts": 8, "top_k": 2, "parallel": {"tensor": 2, "expert": 2}}}

Every field's description says what it is, its default and its constraint, shortly; docs/config.md
renders them into its tables and explains each field at length. Defaults follow GShard and
Megatron-Core where the two agree.
"""
from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moe_plugin.configs import json_text
from moe_plugin.configs.errors import MISSING, ConfigError, FieldProblem, did_you_mean, from_validation_error

ROOT_KEY = "moe"
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Beyond any real job (a million ranks, a million experts per layer); larger sizes are refused
# at once rather than enumerated (their divisors, a layout of every rank).
MAX_SIZE = 2 ** 20
ExpertsBackend = Literal["auto", "grouped_mm", "bmm", "loop"]
ExchangeMode = Literal["auto", "counts", "padded", "token"]


def not_default(block: BaseModel, name: str) -> bool:
    """Whether field ``name`` of ``block`` holds another value than its default (only then is a value
    the block ignores refused)."""
    return getattr(block, name) != type(block).model_fields[name].get_default(call_default_factory=True)


def refuse_unused(block: BaseModel, names: tuple[str, ...], why: str, fix: str) -> None:
    """A ``FieldProblem`` for the first of ``names`` set to other than its default, which ``why`` leaves
    without effect."""
    for name in names:
        if not_default(block, name):
            raise FieldProblem(name, getattr(block, name), f"{why}, so it has no effect; {fix} or leave {name} out")


class _Block(BaseModel):
    # strict: "8" is not 8 and true is not 1; unknown keys are an error; numbers are finite.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ParallelConfig(_Block):
    """Sizes of the parallel dimensions. The data-parallel sizes follow from the world size."""

    tensor: int = Field(1, ge=1, description="Tensor-parallel size (TP) of attention and dense MLPs.")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel size (PP): number of stages.")
    expert: int = Field(1, ge=1, description="Expert-parallel size (EP): ranks that split the experts.")
    expert_tensor: Optional[int] = Field(
        None, ge=1, description="Expert tensor-parallel size (ETP): ranks splitting each expert's FFN. "
        "Default: equal to `tensor`, as in Megatron-Core.")
    order: str = Field(DEFAULT_ORDER, description="Order of the rank grid, fastest-varying first, "
                       "tokens from tp, cp, ep, dp, pp joined by '-' (Megatron-Core's default).")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism: tokens are split "
                                    "across the TP group outside the tensor-parallel GEMMs; needs tensor > 1.")

    @model_validator(mode="after")
    def _check_order(self) -> "ParallelConfig":
        tokens = self.order.lower().split("-")
        for token in tokens:
            if token not in ORDER_TOKENS:
                raise FieldProblem("order", self.order, f"token {token!r} is unknown{did_you_mean(token, ORDER_TOKENS)}; "
                                 f"tokens are {', '.join(ORDER_TOKENS)} joined by '-', e.g. {DEFAULT_ORDER!r}")
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise FieldProblem("order", self.order, f"repeats {', '.join(repeated)}; each token at most once, "
                               f"e.g. {DEFAULT_ORDER!r}")
        missing = [t for t in ("tp", "dp", "pp", "ep") if t not in tokens]
        if missing:
            raise FieldProblem("order", self.order, f"lacks {', '.join(missing)}; "
                             f"it must name tp, ep, dp and pp, e.g. {DEFAULT_ORDER!r}")
        if self.sequence_parallel and self.tensor == 1:
            raise FieldProblem("sequence_parallel", True, "splits tokens across the tensor-parallel ranks, and "
                               "tensor is 1; set tensor > 1 or sequence_parallel false")
        return self

    @property
    def etp(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor


class PlacementConfig(_Block):
    """Load-adaptive expert placement (which rank hosts which expert)."""

    policy: Literal["static", "greedy", "network-aware"] = Field(
        "static", description="static: expert e on EP rank e // (E/EP). greedy: heaviest expert first onto the "
        "least-loaded rank. network-aware: greedy, fewer cross-node routes. Not static: needs parallel.expert > 1.")
    check_interval: int = Field(100, ge=1, description="Steps between two placement checks; needs a policy "
                                "other than static or replica_budget > 0 (as window and min_gain do).")
    window: int = Field(100, ge=1, description="Steps of routing history the load estimate averages.")
    min_gain: float = Field(0.05, ge=0.0, description="Switch only when the predicted saving until the next "
                            "check exceeds the predicted migration cost by this fraction (hysteresis).")
    replica_budget: int = Field(0, ge=0, description="Shadow experts (FasterMoE): at most this many hot experts per "
                                "MoE layer computed by every EP rank for its own tokens; 0: off. At most num_experts; "
                                "needs expert > 1 and expert_tensor 1.")
    slack: float = Field(0.1, ge=0.0, description="network-aware: the busiest rank may carry this fraction "
                         "more load than under greedy placement when that cuts cross-node routes; network-aware only.")
    gpus_per_node: Optional[int] = Field(None, ge=1, description="Ranks per node, for network-aware placement "
                                         "and the cross-node prices of the switching decisions; default: the "
                                         "launcher's local world size. Needs a policy other than static or "
                                         "replica_budget > 0.")
    trace_file: Optional[str] = Field(None, description="Write per-layer, per-step gate traces to this path.")

    @model_validator(mode="after")
    def _check_used(self) -> "PlacementConfig":
        if self.policy == "static" and self.replica_budget == 0:
            refuse_unused(self, ("check_interval", "window", "min_gain", "gpus_per_node"), "policy 'static' with "
                          "replica_budget 0 never checks the load", "set policy 'greedy' or 'network-aware' (or "
                          "replica_budget > 0),")
        if self.policy != "network-aware" and not_default(self, "slack"):
            raise FieldProblem("slack", self.slack, f"only policy 'network-aware' reads it (policy is "
                               f"{self.policy!r}); set policy 'network-aware' or leave slack out")
        return self


class MoEConfig(_Block):
    """The ``"moe"`` block: experts, routing, capacity, balance losses, the exchange, and its two sub-blocks."""

    num_experts: int = Field(..., ge=1, description="Experts per MoE layer (E).")
    top_k: Optional[int] = Field(None, ge=1, description="Experts per token. Default: 2 for gshard, "
                                 "1 for switch; required for topk.")
    router: Literal["gshard", "switch", "topk"] = Field(
        "gshard", description="gshard: top-2 with random routing of the 2nd expert. switch: top-1. "
        "topk: general k.")
    normalize_gates: bool = Field(True, description="Renormalise the k kept gates of a token to sum to 1; "
                                  "router topk only: gshard always renormalises, switch never (its one gate is the "
                                  "softmax probability), so false is refused with them.")
    score_function: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="softmax: gates are softmax probabilities over the experts (GShard, Switch). "
        "sigmoid (DeepSeek-V3): a sigmoid score per expert, the gates the chosen scores; router 'topk' only.")
    expert_bias_on: Optional[Literal["logits", "scores"]] = Field(
        None, description="What the expert bias is added to for the choice: logits, or scores (softmax's "
        "probabilities, as ERNIE-4.5). null: logits with softmax, scores with sigmoid (logits refused there).")
    gate_scale: float = Field(1.0, gt=0, description="Routed scaling factor: every gate is multiplied by it, after "
                              "normalisation (DeepSeek-V3 uses 2.5 with sigmoid scores).")
    group_topk: Optional[int] = Field(
        None, ge=1, description="Group-limited routing (DeepSeek-V3): a token picks its best group_topk expert "
        "groups, then its top_k experts inside them; null: no limit. Needs router_groups; less than router_groups.")
    router_groups: Optional[int] = Field(
        None, ge=1, description="Expert groups G of group_topk (group g: expert ids g * E/G .. (g + 1) * E/G - 1), "
        "a model constant. Required with group_topk, refused without; a divisor of num_experts but 1 and num_experts.")
    group_score: Literal["top2_sum", "max"] = Field(
        "top2_sum", description="How group_topk ranks the expert groups: by the sum of each group's two best "
        "choice scores (DeepSeek-V3, GLM-4.5), or by its best one (DeepSeek-V2's group_limited_greedy).")
    second_expert_policy: Literal["random", "all"] = Field(
        "random", description="gshard only (all is refused with another router). random: keep the 2nd expert "
        "when 2*g2 > U(0,1) (GShard). all: always keep it.")
    capacity_factor: float = Field(1.25, gt=0, description="Training capacity per expert, as a multiple "
                                   "of the even share k*T/E of routed tokens; needs drop_tokens true.")
    eval_capacity_factor: float = Field(2.0, gt=0, description="Capacity factor in evaluation; needs drop_tokens true.")
    min_capacity: int = Field(4, ge=0, description="Lower bound on the per-expert capacity; needs "
                              "drop_tokens true.")
    drop_tokens: bool = Field(True, description="Drop routes over capacity (their tokens keep the residual). "
                              "false: dropless, no capacity at all (capacity_factor, eval_capacity_factor, "
                              "min_capacity and drop_policy then keep their defaults).")
    drop_policy: Literal["position", "probability"] = Field(
        "position", description="Which routes an expert over capacity keeps: position (GShard: first choices "
        "first, earlier tokens first) or probability (highest scores first). probability needs drop_tokens true.")
    aux_loss_coeff: float = Field(1e-2, ge=0, description="Weight of the balance loss (GShard's; "
                                  "for sigmoid scores see score_function; 1.0 before weighting when routing is "
                                  "perfectly uniform).")
    aux_loss_scope: Literal["micro_batch", "sequence", "global"] = Field(
        "micro_batch", description="Tokens the balance loss is taken over: micro_batch (GShard), sequence (each "
        "sequence, averaged) or global (the step's loads over every replica). Not micro_batch: needs "
        "aux_loss_coeff > 0.")
    z_loss_coeff: float = Field(0.0, ge=0, description="Weight of the router z-loss (Switch/ST-MoE), "
                                "mean_t logsumexp(logits_t)^2, for either score_function.")
    bias_update_rate: float = Field(0.0, ge=0, description="Aux-loss-free balancing: step of the per-expert "
                                    "bias added to logits (sigmoid: scores) for expert choice, once per optimizer "
                                    "step (docs/config.md, Formulas); 0 turns it off.")
    jitter_eps: float = Field(0.0, ge=0, lt=1, description="Multiplicative jitter U(1-eps, 1+eps) on the "
                              "router input in training; 0 turns it off.")
    layer_interval: int = Field(1, ge=1, description="Layer i (0-based) is MoE when i % layer_interval == 0.")
    layers: Optional[list[int]] = Field(None, description="Explicit 0-based MoE layer indices; "
                                        "replaces layer_interval.")
    ffn_hidden_size: Optional[int] = Field(None, ge=1, description="FFN size of one expert; default: the "
                                           "model's ffn_hidden_size.")
    activation: Literal["gelu", "swiglu", "relu", "clamped_swiglu"] = Field(
        "gelu", description="Expert activation; swiglu doubles the first expert weight (GLU); clamped_swiglu is "
        "GPT-OSS's clamped GLU (swiglu_alpha, swiglu_limit; docs/config.md).")
    swiglu_alpha: float = Field(1.702, gt=0, description="clamped_swiglu's sigmoid gain (GPT-OSS: 1.702); "
                                "other activations leave it at its default.")
    swiglu_limit: float = Field(7.0, gt=0, description="clamped_swiglu's clamp (GPT-OSS: 7); other activations "
                                "leave it at its default.")
    expert_linear_bias: bool = Field(False, description="Biases on the experts' two projections (GPT-OSS), added "
                                     "before the activation and to each expert's output.")
    router_logit_bias: bool = Field(False, description="A learned bias on the router logits (GPT-OSS): the choice "
                                    "and the gates both see it (unlike the aux-loss-free expert_bias, which only "
                                    "chooses).")
    recompute_fc1: bool = Field(False, description="Experts keep no [routes, ffn] pre-activation for "
                                "backward and recompute it there: one more expert GEMM per step for "
                                "routes x ffn fewer values held per MoE layer.")
    experts_backend: ExpertsBackend = Field(
        "auto", description="The experts' GEMMs: grouped_mm (torch's grouped GEMM), bmm (rows padded per expert, "
        "one batched GEMM), loop (a GEMM per expert) or auto (grouped_mm where it runs, else loop on CPU, bmm "
        "elsewhere).")
    overlap_chunks: int = Field(1, ge=1, description="Chunks of local experts whose exchange overlaps the previous "
                                "chunk's experts; 1: one exchange. At most num_experts / parallel.expert; needs "
                                "parallel.expert > 1 and parallel.expert_tensor 1.")
    exchange: ExchangeMode = Field(
        "counts", description="Wire format of the expert-parallel all-to-all: counts (sizes exchanged first, then "
        "the routed rows), padded (capacity blocks, no counts round), token (a token once per destination rank) or "
        "auto.")
    shared_expert_ffn_hidden_size: int = Field(0, ge=0, description="FFN size of a dense shared expert "
                                               "every token passes through; 0: none.")
    shared_expert_gate: bool = Field(False, description="Scale the shared expert by a learned sigmoid gate.")
    memory_check: bool = Field(True, description="Stop at start, in one line, when the run summary's memory "
                               "estimate per rank exceeds the memory the rank has; false: go on anyway.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallel sizes: the "
                                     "`moe.parallel` block below.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Expert placement: the "
                                       "`moe.placement` block below.")

    @model_validator(mode="before")
    @classmethod
    def _layers_or_interval(cls, data: Any) -> Any:
        interval = cls.model_fields["layer_interval"].default
        if (isinstance(data, dict) and data.get("layer_interval", interval) != interval
                and data.get("layers") is not None):
            raise FieldProblem("layers", data["layers"], "set either layers or layer_interval, not both")
        return data

    @model_validator(mode="after")
    def _check(self) -> "MoEConfig":
        if self.num_experts > MAX_SIZE:
            raise FieldProblem("num_experts", self.num_experts, f"expected at most {MAX_SIZE:,} experts per layer")
        k = self.k
        if self.router == "gshard" and k != 2:
            raise FieldProblem("top_k", k, "router 'gshard' routes to exactly 2 experts; use router 'topk' for other k")
        if self.router == "switch" and k != 1:
            raise FieldProblem("top_k", k, "router 'switch' routes to exactly 1 expert; use router 'topk' for other k")
        if self.score_function == "sigmoid" and self.router != "topk":
            raise FieldProblem("score_function", "sigmoid", f"router {self.router!r} is defined on softmax "
                               "probabilities; sigmoid scores need router 'topk' (with top_k 1 for switch's k)")
        if self.score_function == "sigmoid" and self.expert_bias_on == "logits":
            raise FieldProblem("expert_bias_on", "logits", "sigmoid routing adds the expert bias to its scores; "
                               "leave expert_bias_on out")
        self._check_router_fields()
        if self.aux_loss_scope != "micro_batch" and self.aux_loss_coeff == 0:
            raise FieldProblem("aux_loss_scope", self.aux_loss_scope, "the balance loss is off (aux_loss_coeff 0): "
                               "set aux_loss_coeff > 0 or aux_loss_scope 'micro_batch'")
        if k > self.num_experts:
            raise FieldProblem("top_k", k, f"must be at most num_experts ({self.num_experts})")
        if self.parallel.expert > self.num_experts or self.num_experts % self.parallel.expert:
            raise FieldProblem("parallel.expert", self.parallel.expert, f"must divide num_experts "
                               f"({self.num_experts}); valid: {_divisors(self.num_experts)}")
        self._check_group_limit()
        if self.layers is not None:
            _check_layers(self.layers)
        budget = self.placement.replica_budget
        if budget > self.num_experts:
            raise FieldProblem("placement.replica_budget", budget, f"must be at most num_experts ({self.num_experts})")
        why = self.exchange_unfit(self.exchange, rule="shadow") if budget else None
        if why:
            raise FieldProblem("placement.replica_budget", budget, f"{why}; set replica_budget 0 or change the layout")
        why = self.exchange_unfit(self.exchange, rule="overlap") if self.overlap_chunks > 1 else None
        if why:
            raise FieldProblem("overlap_chunks", self.overlap_chunks, why)
        if self.placement.policy != "static" and self.parallel.expert == 1:
            raise FieldProblem("placement.policy", self.placement.policy, "with parallel.expert 1 every rank holds "
                               "every expert: there is nothing to place; set parallel.expert > 1 or policy 'static'")
        why = self.exchange_unfit(self.exchange) if self.exchange in ("padded", "token") else None
        if why:
            raise FieldProblem("exchange", self.exchange, why + ("; use 'counts' or 'auto'" if self.exchange == "padded"
                                                                 else "; use 'counts'"))
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise FieldProblem("shared_expert_gate", True, "there is no shared expert to gate; set "
                               "shared_expert_ffn_hidden_size > 0 or shared_expert_gate false")
        for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            if getattr(self, key) != default and self.activation != "clamped_swiglu":
                raise FieldProblem(key, getattr(self, key), f"only activation 'clamped_swiglu' has it (activation is "
                                   f"{self.activation!r}); leave it out")
        return self

    def _check_router_fields(self) -> None:
        """Refuse a value that the router kind or the dropless setting never reads (non-default only)."""
        if self.router != "topk":
            what = ("always renormalises its two gates" if self.router == "gshard" else
                    "never renormalises (its one gate is the softmax probability)")
            refuse_unused(self, ("normalize_gates",), f"router {self.router!r} {what}", "use router 'topk'")
        if not_default(self, "second_expert_policy") and self.router != "gshard":
            raise FieldProblem("second_expert_policy", self.second_expert_policy, f"only router 'gshard' has a "
                               f"second expert to keep at random (router is {self.router!r}); use router 'gshard' "
                               "or leave second_expert_policy out")
        if not self.drop_tokens:
            refuse_unused(self, ("capacity_factor", "eval_capacity_factor", "min_capacity", "drop_policy"),
                          "drop_tokens is false (dropless: no capacity, nothing dropped)", "set drop_tokens true")

    def _check_group_limit(self) -> None:
        G, M, E = self.router_groups, self.group_topk, self.num_experts
        if M is None:
            if G is not None:
                raise FieldProblem("router_groups", G, "has no effect without group_topk; set group_topk (the groups "
                                   "a token may use) or leave router_groups out")
            if self.group_score != "top2_sum":
                raise FieldProblem("group_score", self.group_score, "ranks the groups of group_topk, which is not "
                                   "set; leave group_score out")
            return
        valid = _divisors(E, proper=True)
        valid = (f"valid: {valid} (the divisors of num_experts {E} but 1 and {E})" if valid else
                 f"num_experts {E} has no divisor but 1 and {E}, so its experts cannot be grouped")
        if G is None:
            raise FieldProblem("router_groups", MISSING, f"group_topk ({M}) needs router_groups, the number of "
                               f"expert groups (a model constant, the same under every layout); {valid}")
        if E % G or G in (1, E):
            why = {1: "one group holds every expert, so group_topk limits nothing",
                   E: f"groups of one expert limit nothing (the best group_topk >= top_k ({self.k}) groups hold "
                      "a token's best experts)"}.get(G, f"must divide num_experts ({E})")
            raise FieldProblem("router_groups", G, f"{why}; {valid}")
        if M >= G:
            raise FieldProblem("group_topk", M, f"must be less than router_groups ({G}): {M} of {G} groups keep "
                               f"every expert, so nothing is limited; valid: 1 to {G - 1} (no limit: leave "
                               "group_topk and router_groups out)")
        if self.k > M * (E // G):
            raise FieldProblem("group_topk", M, f"its groups hold {M} x {E // G} experts, fewer than top_k "
                               f"({self.k}); with router_groups ({G}) of num_experts {E} it must be at least "
                               f"{-(-self.k // (E // G))}")

    def exchange_unfit(self, mode: str, rule: str = "exchange") -> Optional[str]:
        """Why this config cannot use the ``padded`` or ``token`` exchange (``rule`` "shadow" or "overlap"),
        by the layer's rules, then placement's (``placement/rules.py``); None when it can."""
        from moe_plugin.placement import rules as exchange_rules

        p, pl = self.parallel, self.placement
        if rule == "shadow":
            return exchange_rules.shadow_unfit(p.expert, p.etp)
        if rule == "overlap":
            return exchange_rules.overlap_unfit(self.overlap_chunks, p.expert, p.etp, self.num_experts)
        return exchange_rules.exchange_unfit(mode, expert=p.expert, expert_tensor=p.etp,
                                             overlap_chunks=self.overlap_chunks, drop_tokens=self.drop_tokens,
                                             replica_budget=pl.replica_budget, policy=pl.policy,
                                             trace_file=pl.trace_file)

    @property
    def group_limit(self) -> Optional[tuple[int, int, int]]:
        """``(router_groups, group_topk, n)`` when group-limited routing is on (a group ranked by the sum of
        its n best scores: 2, or 1 for ``group_score`` max), else None."""
        if self.group_topk is None:
            return None
        return self.router_groups, self.group_topk, 1 if self.group_score == "max" else 2

    @property
    def k(self) -> int:
        if self.top_k is not None:
            return self.top_k
        if self.router == "topk":
            raise FieldProblem("top_k", MISSING, "router 'topk' needs top_k: an integer >= 1, "
                               f"at most num_experts ({self.num_experts})")
        return 2 if self.router == "gshard" else 1

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based over the whole model) has an MoE MLP."""
        if self.layers is not None:
            return index in self.layers
        return index % self.layer_interval == 0

    def check_num_layers(self, num_layers: int, flag: str = "num_layers") -> None:
        """``layers`` against the model's depth; ``flag`` names where the depth comes from."""
        beyond = [i for i in self.layers or () if i >= num_layers]
        if beyond:
            raise ConfigError(f"{ROOT_KEY}.layers", self.layers, f"names layer {beyond[0]}, but the model has "
                              f"{num_layers} layers ({flag}); indices are 0-based: 0..{num_layers - 1}")

    def check_world_size(self, world_size: int) -> "ParallelSizes":
        """Cross-checks that need the world size; run before any process group exists."""
        return ParallelSizes.resolve(self.parallel, world_size)

    @classmethod
    def from_ds_config(cls, ds_config: Union[dict, str, os.PathLike]) -> "MoEConfig":
        """Read the ``"moe"`` block of a DeepSpeed config given as a dict or a JSON file path."""
        ds_config = load_ds_config(ds_config)
        if ROOT_KEY not in ds_config:
            raise ConfigError(ROOT_KEY, MISSING, _missing_block_advice(ds_config))
        return cls.from_dict(ds_config[ROOT_KEY])

    @classmethod
    def from_dict(cls, block: Any) -> "MoEConfig":
        if not isinstance(block, dict):
            raise ConfigError(ROOT_KEY, block, "expected a JSON object with at least num_experts")
        try:
            return cls.model_validate(block)
        except ValidationError as err:
            raise from_validation_error(err, cls, ROOT_KEY) from None

    def megatron_parallel_fields(self) -> dict:
        """The ``TransformerConfig`` fields ``parallel`` decides, to splat into it
        (``TransformerConfig(num_layers=..., **moe_config.megatron_parallel_fields())``)."""
        p = self.parallel
        return {"tensor_model_parallel_size": p.tensor, "pipeline_model_parallel_size": p.pipeline,
                "sequence_parallel": p.sequence_parallel}

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def resolved_dict(self) -> dict:
        """Every field, with the defaults that depend on other fields filled in (top_k, expert_tensor)."""
        out = self.to_dict()
        out["top_k"] = self.k
        out["parallel"]["expert_tensor"] = self.parallel.etp
        return out


class ParallelSizes(BaseModel):
    """The resolved sizes of every parallel dimension for one world size."""

    model_config = ConfigDict(frozen=True)

    world_size: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int
    order: str

    @classmethod
    def resolve(cls, p: ParallelConfig, world_size: int) -> "ParallelSizes":
        """The sizes of the ``parallel`` block ``p`` on ``world_size`` ranks, or a ``ConfigError``."""
        path = f"{ROOT_KEY}.parallel"
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError("world_size", world_size, "expected a positive integer")
        if world_size > MAX_SIZE:
            raise ConfigError("world_size", world_size, f"expected at most {MAX_SIZE:,} ranks")
        if world_size % p.pipeline:
            raise ConfigError(f"{path}.pipeline", p.pipeline, f"must divide the world size {world_size}; "
                              f"valid: {_divisors(world_size)}")
        stage = world_size // p.pipeline
        if stage % p.tensor:
            raise ConfigError(f"{path}.tensor", p.tensor, f"must divide the {stage} ranks of a pipeline stage "
                              f"(world size {world_size} / pipeline {p.pipeline}); valid: {_divisors(stage)}")
        if stage % p.etp:
            raise ConfigError(f"{path}.expert_tensor", p.etp, f"must divide the {stage} ranks of a pipeline "
                              f"stage (world size {world_size} / pipeline {p.pipeline}); valid: {_divisors(stage)}")
        if stage % (p.expert * p.etp):
            valid = _divisors(stage // p.etp)
            raise ConfigError(f"{path}.expert", p.expert, f"expert x expert_tensor ({p.expert} x {p.etp}) must "
                              f"divide the {stage} ranks of a pipeline stage (world size {world_size} / "
                              f"pipeline {p.pipeline}); valid with expert_tensor {p.etp}: {valid}")
        dp = stage // p.tensor
        edp = stage // (p.expert * p.etp)
        order = p.order.lower()
        if p.pipeline > 1 and not order.endswith("pp") and edp != dp:
            raise ConfigError(f"{path}.order", p.order, f"with pipeline > 1 the order must end in 'pp' (e.g. "
                              f"{DEFAULT_ORDER!r}) unless the expert data-parallel size ({edp}) equals the "
                              f"data-parallel size ({dp})")
        sizes = cls(world_size=world_size, tp=p.tensor, pp=p.pipeline, dp=dp, ep=p.expert, etp=p.etp,
                    edp=edp, order=order)
        sizes.check_pipeline_span()
        return sizes

    def check_pipeline_span(self) -> None:
        """Refuse grids that cut the ranks into different pipeline stages (the dimensions before 'pp' must
        span as many ranks in each; Megatron-Core asserts the same)."""
        attn = _span_before_pp(self.order, {"tp": self.tp, "dp": self.dp})
        expert = _span_before_pp(self.order, {"tp": self.etp, "ep": self.ep, "dp": self.edp})
        if self.pp > 1 and attn != expert:
            raise ConfigError(f"{ROOT_KEY}.parallel.order", self.order, f"puts pipeline stages {attn} ranks apart in "
                              f"attention (tp {self.tp}, dp {self.dp}) but {expert} apart in the experts (etp "
                              f"{self.etp}, ep {self.ep}, edp {self.edp}); the dimensions before 'pp' must span "
                              f"as many ranks in both grids: put 'pp' last, e.g. {DEFAULT_ORDER!r}")


def _divisors(n: int, shown: int = 32, proper: bool = False) -> str:
    """The divisors of ``n`` as text, a long list cut in the middle; ``proper``: without 1 and ``n``."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = low + [n // d for d in reversed(low) if d * d != n]
    if proper:
        found = [d for d in found if d not in (1, n)]
    if len(found) <= shown:
        return ", ".join(map(str, found))
    return f"{', '.join(map(str, found[:shown - 4]))}, ..., {', '.join(map(str, found[-4:]))} ({len(found)} divisors)"


def _span_before_pp(order: str, sizes: dict[str, int]) -> int:
    """Ranks spanned by the dimensions laid out before 'pp' (missing dimensions have size 1)."""
    tokens = order.split("-")
    return math.prod(sizes.get(t, 1) for t in tokens[:tokens.index("pp")])


def _check_layers(layers: list[int]) -> None:
    if not layers:
        raise FieldProblem("layers", layers, "expected at least one 0-based layer index, or leave layers "
                           "out and use layer_interval")
    negative = [i for i in layers if i < 0]
    if negative:
        raise FieldProblem("layers", layers, f"layer indices are 0-based and >= 0; {negative[0]} is negative")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise FieldProblem("layers", layers, f"repeats {', '.join(map(str, repeated))}; list each layer once")


def _missing_block_advice(ds_config: dict) -> str:
    """Why a DeepSpeed config has no "moe" block: a misspelt key, or none at all."""
    keys = [k for k in ds_config if isinstance(k, str)]
    close = difflib.get_close_matches(ROOT_KEY, [k.lower() for k in keys], n=1, cutoff=0.6)
    if close:
        found = next(k for k in keys if k.lower() == close[0])
        return (f"found key {found!r} instead (did you mean {ROOT_KEY!r}?); the block key is exactly "
                f"{ROOT_KEY!r}, lower case")
    known = f" (its top-level keys: {', '.join(sorted(keys))})" if keys else ""
    return (f"the DeepSpeed config has no {ROOT_KEY!r} block{known}; add one, "
            f"e.g. \"moe\": {{\"num_experts\": 8}}")


def load_ds_config(ds_config: Union[dict, str, os.PathLike]) -> dict:
    """A DeepSpeed config as a dict, from a dict or a file read as ``deepspeed.initialize`` reads it
    (hjson: comments accepted; duplicate keys refused at any depth); errors are ``ConfigError``."""
    where = "DeepSpeed config"
    if isinstance(ds_config, (str, os.PathLike)):
        path = Path(ds_config)
        where = f"DeepSpeed config {path}"
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ConfigError("config file", str(path), f"cannot be read ({err.strerror}); expected "
                              "the path of a DeepSpeed JSON file") from None
        text, marked = json_text.read_text(data, where)   # UTF-8, nesting, bare NaN / Infinity
        try:
            ds_config = _parse(marked)
        except hjson.HjsonDecodeError as err:
            if marked is not text:   # the file's own error, at its own position
                try:
                    _parse(text)
                except hjson.HjsonDecodeError as own:
                    err = own
            raise ConfigError(where, text, "expected a JSON object", shown=f"invalid JSON at line "
                              f"{err.lineno} column {err.colno} ({err.msg})") from None
        ds_config = _without_duplicates(ds_config, "", path.name)
        json_text.refuse_markers(ds_config, text, where)
    if not isinstance(ds_config, dict):
        raise ConfigError(where, ds_config, "expected a JSON object at the top level, "
                          "e.g. {\"train_batch_size\": 8, \"moe\": {\"num_experts\": 8}}")
    return ds_config


def _parse(text: str) -> Any:
    """hjson's reading, as DeepSpeed's; numbers no float or int holds kept as ``json_text`` markers."""
    try:
        return hjson.loads(text, object_pairs_hook=_JSONObject.of, parse_float=json_text.number,
                           parse_int=json_text.integer)
    except RecursionError:   # json_text.read_text bounds the nesting: a last resort
        raise ConfigError("DeepSpeed config", None, "a DeepSpeed JSON nests a few levels",
                          shown="nested too deep to read") from None


class _JSONObject(dict):
    """An object as the file spells it: ``repeated`` holds every value of a key written twice."""

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> "_JSONObject":
        obj = cls()
        obj.repeated = {}
        for key, value in pairs:
            if key in obj:
                obj.repeated.setdefault(key, [obj[key]]).append(value)
            obj[key] = value
        return obj


def _without_duplicates(value: Any, path: str, file: str) -> Any:
    """Plain dicts and lists; a ``ConfigError`` at the first key written more than once."""
    if isinstance(value, list):
        return [_without_duplicates(v, f"{path}[{i}]", file) for i, v in enumerate(value)]
    if not isinstance(value, _JSONObject):
        return value
    for key, values in value.repeated.items():
        raise ConfigError(f"{path}.{key}" if path else key, values, f"the key appears {len(values)} times in "
                          f"{file}; DeepSpeed refuses duplicate keys: keep one",
                          shown=" and ".join(_short(v) for v in values))
    return {k: _without_duplicates(v, f"{path}.{k}" if path else k, file) for k, v in value.items()}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
