"""A Hugging Face model family as the plugin knows it: one subclass of ``Family`` per file.

A family declares its model type and transformers classes, what its ``config.json`` may hold
(MLA, DeepSeek-style group routing, sliding windows, partial rotary, quantized experts), how it reads
into ``HFArchitecture`` fields (``attention_of``, ``moe_of``) and writes back (``config_fields``), its
tensor table (``attention``, ``dense_mlp``, ``mlp`` from ``blocks``), what a checkpoint must have to be
exported as it (``router_checks`` and the flags below) and, for export without ``--arch``, whether a
checkpoint's features name it (``infers``). The generic code in ``interop/`` reads only these.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from moe_plugin.interop.families.blocks import Attention, DenseMLP, MoEBlock

Refuse = Callable[[str, Any, str], Exception]
PLAIN_ROUTER = (("score_function", "softmax"), ("gate_scale", 1.0), ("group_topk", None), ("activation", "swiglu"))


class Family:
    model_type: str
    architecture: str          # the transformers CausalLM class
    config_class: str          # the transformers config class
    title: str                 # as people write it (docs, help)
    order: int                 # where it is listed; MoE families first
    checkpoints: str = ""      # the releases people know it by (docs/huggingface.md's table)
    sets: str = ""             # what the plugin sets for it, in that table's words
    moe: bool = True

    # what the config may hold
    mla: bool = False                     # multi-latent attention (q_lora_rank, kv_lora_rank, ...)
    group_routing: bool = False           # n_group / topk_group / routed_scaling_factor
    window: Optional[str] = None          # sliding windows: "every_layer", "layer_types" or "ignored"
    partial_rotary: bool = False          # partial_rotary_factor
    attention_bias: bool = False          # the config's attention_bias (what it means: attention_of)
    quantized: tuple[str, ...] = ()       # quant methods beyond FP8 blocks that the import dequantizes
    extra_layers: bool = False            # tensors of layers past num_hidden_layers (MTP) left out at import
    expert_ffn_key: str = "moe_intermediate_size"
    use_sliding_window_key: bool = False  # its config switches windows on with use_sliding_window

    # the model: what an exported checkpoint must have
    qk_norm: Optional[bool] = False       # True, False, or None: either (a config key says)
    qk_scope: str = "head"                # "projection": one RMSNorm over all heads of q / of k
    qkv_bias: bool = False                # may have QKV biases
    always_qkv_bias: bool = False         # its readers always have them (zeros are the same function)
    linear_bias: bool = False             # biases on every attention projection
    sinks: bool = False                   # attention sinks
    layers: str = "any"                   # MoE layers: "every", "dense_first" (then MoE to the end), "any"
    shared: Optional[str] = None          # "gated" (a sigmoid gate) or "ungated" shared experts
    infer_rank: Optional[int] = None      # export without --arch tries families by this rank

    # the tensor table
    attention: Attention = Attention()
    dense_mlp: DenseMLP = DenseMLP()
    mlp: Optional[MoEBlock] = None

    # ---- import: config.json -> HFArchitecture fields
    def check(self, cfg: Any, refuse: Refuse) -> None:
        """Refuse what the family's own keys say the plugin cannot represent."""

    def attention_of(self, cfg: Any) -> dict:
        """The attention's fields that depend on the config."""
        return dict(qkv_bias=False, linear_bias=False, attention_sinks=self.sinks,
                    qk_layernorm=bool(self.qk_norm), qk_layernorm_scope=self.qk_scope)

    def moe_of(self, cfg: Any, refuse: Refuse) -> dict:
        """The MoE fields (moe_layers, num_experts, top_k, normalize_gates, expert and shared sizes, ...)."""
        raise NotImplementedError

    def mla_of(self, cfg: Any) -> dict:
        """``mla`` (Megatron's names) and ``rope_interleave`` of a multi-latent attention model."""
        raise NotImplementedError

    def moe_keys(self) -> dict[str, str]:
        """{"moe" block key: the HF key (or the reason) it comes from}, where not the generic one."""
        return {}

    # ---- export: checkpoint -> config.json
    def router_checks(self, moe: dict) -> tuple[tuple[str, Any], ...]:
        """(moe block key, the value this family needs) pairs an exported checkpoint must match."""
        return PLAIN_ROUTER + (("expert_linear_bias", False), ("router_logit_bias", False))

    def check_router(self, moe: dict, refuse: Refuse) -> None:
        """Checks beyond ``router_checks``."""

    def config_fields(self, arch: Any, common: dict) -> dict:
        """The transformers config fields of ``arch`` beyond (or replacing) the ``common`` ones."""
        return {}

    def infers(self, features: dict) -> bool:
        """Whether a checkpoint with these features (moe, qk, activation, mla, score_function, shared,
        qk_scope) is this family, when export is given no --arch."""
        return False

    @property
    def windowed(self) -> bool:
        """Whether the family's models have sliding windows (on every layer or by layer_types)."""
        return self.window in ("every_layer", "layer_types")

    @property
    def has_correction_bias(self) -> bool:
        return self.mlp is not None and self.mlp.router.correction_bias is not None


def every_layer(cfg: Any) -> tuple[int, ...]:
    return tuple(range(cfg.num_hidden_layers))


def sparse_step_layers(cfg: Any) -> tuple[int, ...]:
    """The MoE layers of ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen's)."""
    skip = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(i for i in range(cfg.num_hidden_layers) if i not in skip and (i + 1) % step == 0)


def routed(experts: Any, layers: tuple[int, ...], cfg: Any, refuse: Refuse, **fields: Any) -> dict:
    """The MoE fields of a softmax-routed family (``fields``: the rest, as ``HFArchitecture`` names them)."""
    if not experts or not layers:
        raise refuse("num_experts", experts, "an MoE model type without MoE layers")
    return dict(moe_layers=layers, num_experts=int(experts), top_k=int(cfg.num_experts_per_tok), **fields)


def deepseek_routed(cfg: Any, refuse: Refuse, *, v2: bool = False) -> dict:
    """DeepSeek-style MoE fields: the experts chosen within the token's best ``topk_group`` of ``n_group``
    groups, the gates times ``routed_scaling_factor``; ungated shared experts of ``n_shared_experts x
    moe_intermediate_size``; the layers before ``first_k_dense_replace`` dense. Sigmoid scores with
    ``e_score_correction_bias`` (a group: its two best biased scores), or with ``v2``, DeepSeek-V2's
    softmax, no bias, unnormalised gates, groups only with ``topk_method`` group_limited_greedy
    (each ranked by its best score)."""
    experts, groups, best = int(cfg.n_routed_experts), int(cfg.n_group or 1), int(cfg.topk_group or 1)
    first = int(cfg.first_k_dense_replace or 0)
    layers = tuple(range(first, cfg.num_hidden_layers))
    if not layers:
        raise refuse("first_k_dense_replace", first, "no MoE layer left")
    if experts % groups or not 1 <= best <= groups:
        raise refuse("n_group", groups, f"groups that divide n_routed_experts ({experts}) with topk_group ({best}) "
                     "of them")
    limited = groups > 1 and best < groups   # otherwise every group is kept: no limit
    if v2:
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise refuse("topk_method", method, "DeepSeek-V2 routing other than greedy and group_limited_greedy")
        limited = limited and method == "group_limited_greedy"
    shared = int(cfg.n_shared_experts or 0) * int(cfg.moe_intermediate_size)
    return dict(moe_layers=layers, num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                normalize_gates=not v2 and bool(cfg.norm_topk_prob), expert_ffn_hidden_size=int(cfg.moe_intermediate_size),
                shared_ffn_hidden_size=shared, shared_gate=False, score_function="softmax" if v2 else "sigmoid",
                gate_scale=float(cfg.routed_scaling_factor), router_groups=groups if limited else None,
                group_topk=best if limited else None, router_bias=not v2,
                group_score="max" if v2 and limited else "top2_sum")


def partial_rope(arch: Any, rope_parameters: dict) -> dict:
    """``rope_parameters`` with ``arch``'s partial_rotary_factor where it rotates part of each head."""
    rope = dict(rope_parameters)
    if arch.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = arch.rotary_percent
    return rope


def deepseek_config(arch: Any, rope_parameters: dict) -> dict:
    """The DeepSeek-style config fields of ``arch`` (GLM-4.5, DeepSeek-V2/V3, ...)."""
    rope = partial_rope(arch, rope_parameters)
    first = arch.moe_layers[0] if arch.moe_layers else arch.num_layers
    return dict(n_routed_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                moe_intermediate_size=arch.expert_ffn_hidden_size,
                n_shared_experts=arch.shared_ffn_hidden_size // arch.expert_ffn_hidden_size,
                first_k_dense_replace=first, n_group=arch.router_groups or 1, topk_group=arch.group_topk or 1,
                routed_scaling_factor=arch.gate_scale, norm_topk_prob=arch.normalize_gates,
                attention_bias=arch.qkv_bias, rope_parameters=rope)


DEEPSEEK_KEYS = {
    "num_experts": "n_routed_experts", "gate_scale": "routed_scaling_factor", "group_topk": "topk_group",
    "router_groups": "n_group", "shared_expert_ffn_hidden_size": "n_shared_experts x moe_intermediate_size",
    "shared_expert_gate": "(the shared experts are not gated)", "layers": "first_k_dense_replace"}


class DeepSeekStyle(Family):
    """The DeepSeek-style MoE: group-limited choice, routed scaling, ungated shared experts, the first
    layers dense, the MTP layers past num_hidden_layers left out."""

    group_routing = True
    extra_layers = True
    layers = "dense_first"
    shared = "ungated"

    def moe_of(self, cfg: Any, refuse: Refuse) -> dict:
        return deepseek_routed(cfg, refuse)

    def moe_keys(self) -> dict[str, str]:
        return DEEPSEEK_KEYS

    def router_checks(self, moe: dict) -> tuple[tuple[str, Any], ...]:   # sigmoid scores; any scale and groups
        return (("score_function", "sigmoid"), ("activation", "swiglu"), ("group_score", "top2_sum"),
                ("expert_linear_bias", False), ("router_logit_bias", False))

    def config_fields(self, arch: Any, common: dict) -> dict:
        return deepseek_config(arch, common["rope_parameters"])
