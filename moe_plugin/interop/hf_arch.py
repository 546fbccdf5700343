"""A Hugging Face ``config.json`` as the plugin's model, or refused naming the key.

``read_hf_config(hf_dir)`` reads the directory's config with transformers' ``AutoConfig`` (its defaults
and legacy spellings resolved) into an ``HFArchitecture``: the sizes, the attention, RoPE, the norms,
and for MoE models the router's semantics, the expert and shared-expert sizes and which layers are
MoE. From it come Megatron's ``TransformerConfig`` fields, the ``"moe"`` block (each field with the HF
key it comes from) and the example's flags that build the same model. What each family means is
declared in its file under ``interop/families/``; this module reads the family and names none. What
the plugin cannot represent is refused before anything is written, naming the key and the model type.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from moe_plugin.configs import ConfigError
from moe_plugin.data.hf_tokenizer import HF_EXTRA
from moe_plugin.interop.families import REGISTRY, family, titles

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# Keys of multi-latent attention and of DeepSeek-style routing, refused outside the families that have them.
UNSUPPORTED_KEYS = ("kv_lora_rank", "q_lora_rank")
ROUTING_KEYS = ("n_group", "topk_group", "routed_scaling_factor")
LATENT_NORM_EPS = 1e-6   # transformers' DeepSeek q_a_layernorm / kv_a_layernorm (fixed; Megatron: layernorm_epsilon)


def transformers_module() -> Any:
    """transformers, or a one-line error naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("transformers", None, f"the Hugging Face import and export need it: {HF_EXTRA}",
                          shown="not installed") from None
    return transformers


@dataclass(frozen=True)
class HFArchitecture:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), dense or with MoE MLPs."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int            # the dense MLPs' (intermediate_size)
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    tied: bool
    qkv_bias: bool
    qk_layernorm: bool
    dtype: str
    qk_layernorm_scope: str = "head"   # "projection": one RMSNorm over all heads of q / of k (OLMoE)
    rotary_percent: float = 1.0        # the share of a head's dimensions RoPE rotates (GLM-4.5: 0.5)
    rope_scaling: Optional[dict] = None   # YaRN's parameters (integration.rope.RopeScaling.to_dict)
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    normalize_gates: bool = True
    expert_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0
    shared_gate: bool = False
    score_function: str = "softmax"    # sigmoid: DeepSeek-style scores
    gate_scale: float = 1.0            # routed_scaling_factor
    router_groups: Optional[int] = None
    group_topk: Optional[int] = None
    router_bias: bool = False          # e_score_correction_bias: the plugin's router.expert_bias
    expert_bias_on: Optional[str] = None   # "scores": the bias added to the softmax probabilities (ERNIE-4.5)
    group_score: str = "top2_sum"      # how a group is ranked ("max": DeepSeek-V2's group_limited_greedy)
    mla: Optional[dict] = None         # multi-latent attention's sizes (MLA_KEYS, Megatron's names)
    rope_interleave: bool = True       # MLA: the rotated dimensions in (even, odd) pairs, as Megatron's MLA rotates
    window: Optional[int] = None       # sliding window W: a query sees itself and the W - 1 keys before it
    window_layers: Optional[tuple[int, ...]] = None   # 1: windowed layer, 0: full (None: every layer windowed)
    linear_bias: bool = False          # biases on the attention's projections, o_proj's too (GPT-OSS; add_bias_linear)
    attention_sinks: bool = False      # a learned sink logit per head (GPT-OSS; softmax_type learnable)
    activation: str = "swiglu"         # the experts' ("clamped_swiglu": GPT-OSS's, with swiglu_alpha / swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_linear_bias: bool = False   # the experts' gate_up_proj_bias / down_proj_bias (GPT-OSS)
    router_logit_bias: bool = False    # the router's bias on its logits (GPT-OSS)
    config: Optional[dict] = None   # the config as transformers writes it (to_dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def family(self) -> Any:
        return family(self.model_type)

    @property
    def architecture(self) -> str:
        return self.family.architecture

    def moe_fields(self) -> dict[str, tuple[Any, str]]:
        """{"moe" block key: (the value this model needs, the HF key it comes from)}; MoE models only."""
        fam = self.family
        keys = fam.moe_keys()
        every = self.moe_layers == tuple(range(self.num_layers))
        scores = ("the router: sigmoid scores with e_score_correction_bias" if self.score_function == "sigmoid"
                  else "the router: top-k of a softmax over the experts")
        sources = {
            "num_experts": "num_experts", "top_k": "num_experts_per_tok",
            "router": "the router: top-k of the experts' scores", "score_function": scores,
            "normalize_gates": "norm_topk_prob", "gate_scale": "the router (gates are not scaled)",
            "group_topk": "the router (no group limit)", "router_groups": "the router (no group limit)",
            "group_score": ("topk_method (group_limited_greedy: a group's best score)" if self.group_score == "max"
                            else "the router (a group's two best scores)"),
            "activation": "hidden_act (silu, gated)", "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit",
            "expert_linear_bias": "(no expert biases)", "router_logit_bias": "(no router bias)",
            "ffn_hidden_size": fam.expert_ffn_key, "shared_expert_ffn_hidden_size": "(no shared expert)",
            "shared_expert_gate": "(no shared expert)", "drop_tokens": "the experts (transformers drops no token)",
            "layers": "decoder_sparse_step / mlp_only_layers",
            "expert_bias_on": "the router (the bias on the logits, or sigmoid's scores)"} | keys
        if every:
            sources["layers"] = "every layer"
        values = {
            "num_experts": self.num_experts, "top_k": self.top_k, "router": "topk",
            "score_function": self.score_function, "normalize_gates": self.normalize_gates,
            "gate_scale": self.gate_scale, "group_topk": self.group_topk, "router_groups": self.router_groups,
            "group_score": self.group_score, "activation": self.activation, "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit, "expert_linear_bias": self.expert_linear_bias,
            "router_logit_bias": self.router_logit_bias, "ffn_hidden_size": self.expert_ffn_hidden_size,
            "shared_expert_ffn_hidden_size": self.shared_ffn_hidden_size, "shared_expert_gate": self.shared_gate,
            "drop_tokens": False, "layers": None if every else list(self.moe_layers),
            "expert_bias_on": self.expert_bias_on}
        return {key: (value, sources[key]) for key, value in values.items()}

    def transformer_fields(self) -> dict:
        """Megatron ``TransformerConfig`` fields of the architecture (as the example's flags set them)."""
        import torch.nn.functional as F

        fields = dict(num_layers=self.num_layers, hidden_size=self.hidden_size,
                      num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
                      kv_channels=self.kv_channels, ffn_hidden_size=self.ffn_hidden_size, normalization="RMSNorm",
                      layernorm_epsilon=self.norm_epsilon, gated_linear_unit=True, activation_func=F.silu,
                      bias_activation_fusion=False, add_bias_linear=self.linear_bias, add_qkv_bias=self.qkv_bias,
                      qk_layernorm=self.qk_layernorm)
        if self.attention_sinks:
            fields.update(softmax_type="learnable")
        if self.mla:
            from moe_plugin.integration.megatron import mla_fields

            fields.update(mla_fields(**self.mla, rotary_base=self.rotary_base, rope_scaling=self.rope_scaling))
        if self.window:
            fields.update(window_size=(self.window - 1, 0),
                          window_attn_skip_freq=list(self.window_layers) if self.window_layers else None)
        return fields

    def model_fields(self) -> dict:
        """``GPTModel``'s own arguments: position embedding, RoPE base, tied embeddings."""
        out = {"position_embedding_type": "rope", "rotary_base": self.rotary_base, "tied": self.tied}
        if self.qk_layernorm_scope != "head":
            out["qk_layernorm_scope"] = self.qk_layernorm_scope
        if self.rotary_percent != 1.0:
            out["rotary_percent"] = self.rotary_percent
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    def example_flags(self) -> list[str]:
        """examples/gpt_moe/pretrain_gpt_moe.py flags that build this model (Megatron-LM's names)."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--num-attention-heads", str(self.num_attention_heads), "--ffn-hidden-size", str(self.ffn_hidden_size)]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.mla:
            flags.append("--multi-latent-attention")
            for key in MLA_KEYS:
                if self.mla[key] is not None:
                    flags += ["--" + key.replace("_", "-"), str(self.mla[key])]
        if self.kv_channels * self.num_attention_heads != self.hidden_size:
            flags += ["--kv-channels", str(self.kv_channels)]
        flags += ["--normalization", "RMSNorm", "--norm-epsilon", repr(self.norm_epsilon),
                  "--position-embedding-type", "rope", "--rotary-base", _number(self.rotary_base), "--swiglu"]
        if not self.linear_bias:
            flags.append("--disable-bias-linear")
        if self.attention_sinks:
            flags += ["--softmax-type", "learnable"]
        if self.rotary_percent != 1.0:
            flags += ["--rotary-percent", repr(float(self.rotary_percent))]
        if self.rope_scaling:
            import json

            flags += ["--rope-scaling", json.dumps(self.rope_scaling, separators=(",", ":"))]
        if self.window:
            flags += ["--window-size", f"{self.window - 1},0"]
            if self.window_layers:
                flags += ["--window-attn-skip-freq", "[" + ",".join(map(str, self.window_layers)) + "]"]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.qk_layernorm_scope != "head":
            flags += ["--qk-layernorm-scope", self.qk_layernorm_scope]
        if not self.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if not self.is_moe:
            flags.append("--dense")
        return flags


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def read_hf_config(hf_dir: os.PathLike | str) -> HFArchitecture:
    """The model of ``hf_dir/config.json``, or a ``ConfigError`` naming the key it cannot represent; its
    sizes checked against each other and against the weights' headers first (``hf_sizes``)."""
    from moe_plugin.interop import hf_sizes
    from moe_plugin.interop.hf_files import HFWeights

    hf_dir = os.fspath(hf_dir)
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(path, None, "expected a Hugging Face model directory (config.json and model.safetensors "
                          "or its sharded index, as save_pretrained writes them)", shown="missing")
    transformers = transformers_module()
    raw = hf_sizes.read_config_json(path)
    fam = family(raw.get("model_type"), path)
    hf_sizes.check_values(raw, path)
    weights = HFWeights(hf_dir)
    try:
        hf_sizes.check_against_headers(raw, weights, path, beyond_allowed=fam.extra_layers)
        hf_sizes.check_relations(raw, path, mla=fam.mla)
        try:
            cfg = transformers.AutoConfig.from_pretrained(hf_dir)
        except hf_sizes.transformers_refusals() as err:   # a value of the wrong kind
            raise hf_sizes.refused_by_transformers(path, err) from None
        arch = architecture_of(cfg, path)
        hf_sizes.check_headers(arch, weights, path)
    finally:
        weights.close()
    return arch


def architecture_of(cfg: Any, where: str = "config.json") -> HFArchitecture:
    """``HFArchitecture`` of a transformers config object (``where`` names it in errors)."""
    t = cfg.model_type
    fam = family(t, where)

    def refuse(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{where}: {key}", value, f"{why} (model_type {t}); the plugin cannot represent it")

    for key in () if fam.mla else UNSUPPORTED_KEYS:
        if getattr(cfg, key, None) not in (None, 0):
            raise refuse(key, getattr(cfg, key), "multi-latent attention outside "
                         + titles(f for f in REGISTRY if f.mla))
    for key in () if fam.group_routing else ROUTING_KEYS:
        if getattr(cfg, key, None) not in (None, 0):
            raise refuse(key, getattr(cfg, key), "group-limited DeepSeek routing outside its families")
    if cfg.hidden_act != "silu":
        raise refuse("hidden_act", cfg.hidden_act, "the plugin's gated MLPs and experts are SwiGLU (silu)")
    window, window_layers = _sliding_window(cfg, fam, refuse)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        rope = {**scaling, **rope}
    kind = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if kind == "yarn":   # integration.rope
        from moe_plugin.integration.rope import RopeScaling

        if rope.get("factor") is None and rope.get("original_max_position_embeddings"):   # DeepSeek's way
            rope["factor"] = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        rope_scaling = RopeScaling.from_dict(rope, f"{where}: rope_parameters").to_dict()
    elif kind != "default":
        raise refuse("rope_parameters.rope_type", kind, "RoPE scaling other than yarn")
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not fam.partial_rotary:
        raise refuse("partial_rotary_factor", partial, "partial rotary embeddings outside "
                     + titles(f for f in REGISTRY if f.partial_rotary))
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise refuse("rope_parameters.rope_theta", None, "RoPE without its base")
    if getattr(cfg, "attention_bias", False) and not fam.attention_bias:
        raise refuse("attention_bias", True, "biases on the query/key/value and output projections (the plugin "
                     "has QKV biases only, Megatron's add_qkv_bias)")
    if getattr(cfg, "mlp_bias", False):
        raise refuse("mlp_bias", True, "MLP biases (the plugin's experts have none)")
    quant = getattr(cfg, "quantization_config", None)
    if quant is not None:
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        fp8 = quant.get("quant_method") == "fp8" and quant.get("weight_block_size")
        if not fp8 and quant.get("quant_method") not in fam.quantized:
            raise refuse("quantization_config.quant_method", quant.get("quant_method"), "quantized weights other "
                         "than FP8 in blocks (weight_block_size) and the MXFP4 experts of "
                         + titles(f for f in REGISTRY if "mxfp4" in f.quantized) + ", which the import dequantizes")
    if getattr(cfg, "clip_qkv", None) is not None:
        raise refuse("clip_qkv", cfg.clip_qkv, "clamping the query/key/value projections")
    fam.check(cfg, refuse)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    common = dict(model_type=t, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                  num_attention_heads=heads, num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
                  kv_channels=head_dim, ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                  max_position_embeddings=cfg.max_position_embeddings, norm_epsilon=float(cfg.rms_norm_eps),
                  rotary_base=float(theta), tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                  dtype=str(dtype).replace("torch.", ""), rotary_percent=float(partial or 1.0),
                  rope_scaling=rope_scaling, window=window, window_layers=window_layers, config=cfg.to_dict(),
                  **fam.attention_of(cfg))
    if fam.mla:
        if float(cfg.rms_norm_eps) != LATENT_NORM_EPS:
            raise refuse("rms_norm_eps", cfg.rms_norm_eps, f"a norm epsilon other than {LATENT_NORM_EPS} with "
                         f"multi-latent attention (transformers normalises the compressed query and key/value with "
                         f"{LATENT_NORM_EPS}, Megatron's MLA with the model's epsilon)")
        common.update(fam.mla_of(cfg), kv_channels=cfg.hidden_size // heads, num_query_groups=heads, qk_layernorm=True,
                      qkv_bias=False)
    if not fam.moe:
        return HFArchitecture(**common)
    return HFArchitecture(**{**common, **fam.moe_of(cfg, refuse)})


def _sliding_window(cfg: Any, fam: Any, refuse: Any) -> tuple[Optional[int], Optional[tuple[int, ...]]]:
    """(window W or None, the windowed layers or None for every layer), as transformers 5.24 applies
    them: ``sliding_window`` on every layer (families of ``window`` "every_layer"), or on the layers
    whose ``layer_types`` entry is "sliding_attention" ("layer_types"); refused elsewhere."""
    if fam.window == "ignored":   # the family's model applies none
        return None, None
    size = getattr(cfg, "sliding_window", None)
    kinds = list(getattr(cfg, "layer_types", None) or [])
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise refuse("layer_types", unknown, "layers other than full and sliding-window attention")
    if fam.window == "layer_types":
        if "sliding_attention" not in kinds:
            return None, None
        if not size:
            raise refuse("sliding_window", size, "sliding-window layers without a window")
        pattern = tuple(int(kind == "sliding_attention") for kind in kinds)
        return int(size), None if all(pattern) else pattern
    if "sliding_attention" in kinds:
        raise refuse("layer_types", kinds, "sliding-window layers outside "
                     + titles(f for f in REGISTRY if f.window == "layer_types"))
    if size in (None, 0):
        return None, None
    if fam.window != "every_layer":
        raise refuse("sliding_window", size, "sliding-window attention outside "
                     + titles(f for f in REGISTRY if f.windowed))
    return int(size), None
