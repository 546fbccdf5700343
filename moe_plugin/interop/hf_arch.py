"""A Hugging Face ``config.json`` as the plugin's model, or refused naming the key.

``read_hf_config(hf_dir)`` reads the directory's config with transformers' ``AutoConfig`` (its
defaults and legacy spellings resolved) into an ``HFArchitecture``: the sizes, the attention
(grouped-query heads, head size, QKV bias, QK-norm), RoPE, the norms, and for MoE models the
router's semantics (softmax over all experts, top-k, the k gates renormalised or not), the expert
and shared-expert FFN sizes and which layers are MoE. From it come Megatron's ``TransformerConfig``
fields (``transformer_fields``), the ``"moe"`` block fields (``moe_fields``, each with the HF key it
comes from) and the example's flags that build the same model (``example_flags``).

What the plugin cannot represent is refused before anything is written, naming the config key and
the model type: an unknown ``model_type``, sliding-window attention outside the families that have
it (Mistral, Mixtral and Qwen3-MoE on every layer, Qwen3 and Qwen2-MoE per ``layer_types``: Megatron's
``window_size`` (W - 1, 0) and ``window_attn_skip_freq``; GPT-OSS per ``layer_types``), RoPE scaling or partial
rotary, an activation other than SiLU, biases on the output projection or the MLPs, multi-latent
attention outside DeepSeek-V2/V3. The router semantics per family (transformers 5.24):

    mixtral     softmax over the experts, top-k, the k gates renormalised (always)
    qwen3_moe   softmax, top-k, renormalised iff norm_topk_prob; QK-norm (RMSNorm per head)
    qwen2_moe   softmax, top-k, renormalised iff norm_topk_prob; shared expert (SwiGLU) scaled by
                sigmoid(shared_expert_gate(x)); QKV bias (qkv_bias, default true)
    olmoe       softmax, top-k, renormalised iff norm_topk_prob (default false); every layer MoE;
                QK-norm as one RMSNorm over the whole query and key projections (all heads at once:
                ``qk_layernorm_scope`` "projection", the example's ``--qk-layernorm-scope projection``);
                clip_qkv refused
    glm4_moe    sigmoid scores; e_score_correction_bias (the plugin's expert_bias) added for the choice
                only, within the best topk_group of n_group groups (a group: its two best biased scores);
                gates the chosen scores, renormalised iff norm_topk_prob, times routed_scaling_factor;
                ungated shared experts (n_shared_experts x moe_intermediate_size); layers before
                first_k_dense_replace dense; attention_bias = QKV biases; use_qk_norm per head;
                partial_rotary_factor (--rotary-percent); the MTP layers' tensors left out
    deepseek_v3 GLM-4.5's routing (no QKV bias, no partial rotary) with multi-latent attention: Megatron's
                MLASelfAttention (``mla``: q_lora_rank, kv_lora_rank, qk_nope_head_dim as qk_head_dim,
                qk_rope_head_dim as qk_pos_emb_head_dim, v_head_dim; --qk-layernorm for its latent norms,
                whose epsilon transformers fixes at 1e-6); rope_interleave (Megatron's MLA rotates
                interleaved pairs: false means the import interleaves the rotated rows)
    deepseek_v2 the same attention (always interleaved); softmax scores, no bias, gates not renormalised,
                times routed_scaling_factor; topk_method group_limited_greedy: the groups ranked by their
                best score (group_score "max"), greedy: no limit
    gpt_oss     a softmax over the top-k logits (the top-k of a softmax, renormalised); the router's logit bias
                (``router_logit_bias``); every layer MoE; the experts' clamped SwiGLU (``clamped_swiglu``:
                swiglu_alpha, swiglu_limit) with biases (``expert_linear_bias``), their weights fused as
                [E, H, 2F] with gate and up interleaved (``hf_families``; MXFP4 blocks dequantized at import);
                biases on q/k/v and o_proj (attention_bias: Megatron's add_bias_linear); attention sinks (Megatron's
                softmax_type learnable); sliding and full layers by ``layer_types``; YaRN
    llama, mistral, qwen3   dense (upcycling); qwen3 with QK-norm

The router choice, capacity and gates map onto the ``"moe"`` block as router ``topk``,
``normalize_gates``, ``score_function`` softmax, ``drop_tokens`` false (transformers drops no token),
``gate_scale`` 1, ``shared_expert_gate`` true for Qwen2-MoE.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from moe_plugin.configs import ConfigError
from moe_plugin.data.hf_tokenizer import HF_EXTRA
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3", "deepseek_v2", "gpt_oss")
# DeepSeek-style MoE (group-limited choice, routed scaling, shared experts, the first layers dense;
# sigmoid scores with a correction bias but DeepSeek-V2's softmax) ...
DEEPSEEK_ROUTED = ("glm4_moe", "deepseek_v3", "deepseek_v2")
# ... with multi-latent attention (Megatron's MLASelfAttention; the others: grouped-query attention)
MLA_TYPES = ("deepseek_v3", "deepseek_v2")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# sliding windows: on every layer, or on the layers ``layer_types`` names
WINDOW_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")
WINDOW_BY_LAYER_TYPES = ("qwen3", "qwen2_moe", "gpt_oss")
# families whose experts are sized by intermediate_size (no dense MLP of another size)
EXPERTS_BY_INTERMEDIATE = ("mixtral", "olmoe", "gpt_oss")
# Keys of models the plugin has no layer for (multi-latent attention), and DeepSeek-style routing's
# outside the families that have it.
UNSUPPORTED_KEYS = ("kv_lora_rank", "q_lora_rank")
ROUTING_KEYS = ("n_group", "topk_group", "routed_scaling_factor")


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
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    def moe_fields(self) -> dict[str, tuple[Any, str]]:
        """{"moe" block key: (the value this model needs, the HF key it comes from)}; MoE models only."""
        t = self.model_type
        every = tuple(range(self.num_layers))
        deepseek = t in DEEPSEEK_ROUTED
        layers = (None, "every layer") if self.moe_layers == every else (
            list(self.moe_layers), "first_k_dense_replace" if deepseek else "decoder_sparse_step / mlp_only_layers")
        shared_key = {"qwen2_moe": "shared_expert_intermediate_size"}.get(
            t, "n_shared_experts x moe_intermediate_size" if deepseek else "(no shared expert)")
        fields = {
            "num_experts": (self.num_experts, "n_routed_experts" if deepseek else
                            {"mixtral": "num_local_experts"}.get(t, "num_experts")),
            "top_k": (self.top_k, "num_experts_per_tok"),
            "router": ("topk", "the router: top-k of the experts' scores"),
            "score_function": (self.score_function, "the router: sigmoid scores with e_score_correction_bias"
                               if self.score_function == "sigmoid"
                               else "the router: top-k of a softmax over the experts"),
            "normalize_gates": (self.normalize_gates, {"mixtral": "the router (Mixtral renormalises the top-k gates)",
                                                       "deepseek_v2": "the router (DeepSeek-V2 does not renormalise)"}
                                .get(t, "norm_topk_prob")),
            "gate_scale": (self.gate_scale, "routed_scaling_factor" if deepseek
                           else "the router (gates are not scaled)"),
            "group_topk": (self.group_topk, "topk_group" if deepseek else "the router (no group limit)"),
            "router_groups": (self.router_groups, "n_group" if deepseek else "the router (no group limit)"),
            "group_score": (self.group_score, "topk_method (group_limited_greedy: a group's best score)"
                            if self.group_score == "max" else "the router (a group's two best scores)"),
            "activation": (self.activation, "the experts (GPT-OSS's clamped SwiGLU)" if self.activation != "swiglu"
                           else "hidden_act (silu, gated)"),
            "swiglu_alpha": (self.swiglu_alpha, "swiglu_alpha"),
            "swiglu_limit": (self.swiglu_limit, "swiglu_limit"),
            "expert_linear_bias": (self.expert_linear_bias, "the experts' gate_up_proj_bias and down_proj_bias"
                                   if self.expert_linear_bias else "(no expert biases)"),
            "router_logit_bias": (self.router_logit_bias, "the router's bias" if self.router_logit_bias
                                  else "(no router bias)"),
            "ffn_hidden_size": (self.expert_ffn_hidden_size, "intermediate_size" if t in EXPERTS_BY_INTERMEDIATE
                                else "moe_intermediate_size"),
            "shared_expert_ffn_hidden_size": (self.shared_ffn_hidden_size, shared_key),
            "shared_expert_gate": (self.shared_gate, "shared_expert_gate (a sigmoid gate)" if t == "qwen2_moe"
                                   else "(the shared experts are not gated)" if deepseek else "(no shared expert)"),
            "drop_tokens": (False, "the experts (transformers drops no token)"),
            "layers": layers,
        }
        return fields

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
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{path}: model_type", model_type, f"the plugin imports {', '.join(ARCHITECTURES)}")
    hf_sizes.check_values(raw, path)
    weights = HFWeights(hf_dir)
    try:
        hf_sizes.check_against_headers(raw, weights, path, beyond_allowed=model_type in DEEPSEEK_ROUTED)
        hf_sizes.check_relations(raw, path, mla=model_type in MLA_TYPES)
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
    if t not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type", t, f"the plugin imports {', '.join(ARCHITECTURES)}")

    def refuse(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{where}: {key}", value, f"{why} (model_type {t}); the plugin cannot represent it")

    for key in () if t in MLA_TYPES else UNSUPPORTED_KEYS:
        if getattr(cfg, key, None) not in (None, 0):
            raise refuse(key, getattr(cfg, key), "multi-latent attention outside DeepSeek-V2/V3")
    deepseek = t in DEEPSEEK_ROUTED
    for key in () if deepseek else ROUTING_KEYS:
        if getattr(cfg, key, None) not in (None, 0):
            raise refuse(key, getattr(cfg, key), "group-limited DeepSeek routing outside its families")
    if cfg.hidden_act != "silu":
        raise refuse("hidden_act", cfg.hidden_act, "the plugin's gated MLPs and experts are SwiGLU (silu)")
    window, window_layers = _sliding_window(cfg, refuse)
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
    if partial not in (None, 1, 1.0) and t != "glm4_moe":
        raise refuse("partial_rotary_factor", partial, "partial rotary embeddings outside GLM-4.5")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise refuse("rope_parameters.rope_theta", None, "RoPE without its base")
    if getattr(cfg, "attention_bias", False) and t not in ("glm4_moe", "gpt_oss"):   # GLM-4.5's: QKV biases only
        raise refuse("attention_bias", True, "biases on the query/key/value and output projections (the plugin "
                     "has QKV biases only, Megatron's add_qkv_bias)")
    if getattr(cfg, "mlp_bias", False):
        raise refuse("mlp_bias", True, "MLP biases (the plugin's experts have none)")
    quant = getattr(cfg, "quantization_config", None)
    if quant is not None:
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        fp8 = quant.get("quant_method") == "fp8" and quant.get("weight_block_size")
        if not fp8 and not (t == "gpt_oss" and quant.get("quant_method") == "mxfp4"):
            raise refuse("quantization_config.quant_method", quant.get("quant_method"), "quantized weights other "
                         "than FP8 in blocks (weight_block_size) and GPT-OSS's MXFP4 experts, which the import "
                         "dequantizes")
    if getattr(cfg, "clip_qkv", None) is not None:
        raise refuse("clip_qkv", cfg.clip_qkv, "clamping the query/key/value projections")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    common = dict(model_type=t, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                  num_attention_heads=heads, num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
                  kv_channels=head_dim, ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                  max_position_embeddings=cfg.max_position_embeddings, norm_epsilon=float(cfg.rms_norm_eps),
                  rotary_base=float(theta), tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                  qkv_bias=(t == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True))
                            or (deepseek or t == "gpt_oss") and bool(getattr(cfg, "attention_bias", False))),
                  linear_bias=t == "gpt_oss" and bool(getattr(cfg, "attention_bias", False)),
                  attention_sinks=t == "gpt_oss",
                  qk_layernorm=(t in ("qwen3", "qwen3_moe", "olmoe")
                                or deepseek and bool(getattr(cfg, "use_qk_norm", False))),
                  dtype=str(dtype).replace("torch.", ""), rotary_percent=float(partial or 1.0),
                  rope_scaling=rope_scaling,
                  qk_layernorm_scope="projection" if t == "olmoe" else "head", window=window,
                  window_layers=window_layers, config=cfg.to_dict())
    if t in MLA_TYPES:
        if float(cfg.rms_norm_eps) != LATENT_NORM_EPS:
            raise refuse("rms_norm_eps", cfg.rms_norm_eps, f"a norm epsilon other than {LATENT_NORM_EPS} with "
                         f"multi-latent attention (transformers normalises the compressed query and key/value with "
                         f"{LATENT_NORM_EPS}, Megatron's MLA with the model's epsilon)")
        common.update(_mla(cfg), kv_channels=cfg.hidden_size // heads, num_query_groups=heads, qk_layernorm=True,
                      qkv_bias=False)
    if t not in MOE_TYPES:
        return HFArchitecture(**common)
    if t == "mixtral":
        experts, layers, normalize = cfg.num_local_experts, tuple(range(cfg.num_hidden_layers)), True
    elif t == "olmoe":
        experts, layers, normalize = cfg.num_experts, tuple(range(cfg.num_hidden_layers)), bool(cfg.norm_topk_prob)
    elif t == "gpt_oss":   # a softmax over the top-k logits: the top-k of a softmax, renormalised
        experts, layers, normalize = cfg.num_local_experts, tuple(range(cfg.num_hidden_layers)), True
        common.update(activation="clamped_swiglu", swiglu_alpha=float(cfg.swiglu_alpha),
                      swiglu_limit=float(cfg.swiglu_limit), expert_linear_bias=True, router_logit_bias=True)
    elif deepseek:
        return _deepseek_routed(cfg, common, refuse)
    else:
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts")
        skip = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        layers = tuple(i for i in range(cfg.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
        normalize = bool(cfg.norm_topk_prob)
    if not experts or not layers:
        raise refuse("num_experts", experts, "an MoE model type without MoE layers")
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if t == "qwen2_moe" else 0
    return HFArchitecture(**common, moe_layers=layers, num_experts=int(experts), top_k=int(cfg.num_experts_per_tok),
                          normalize_gates=normalize,
                          expert_ffn_hidden_size=int(cfg.intermediate_size if t in EXPERTS_BY_INTERMEDIATE else
                                                     cfg.moe_intermediate_size),
                          shared_ffn_hidden_size=shared, shared_gate=shared > 0)


def _sliding_window(cfg: Any, refuse: Any) -> tuple[Optional[int], Optional[tuple[int, ...]]]:
    """(window W or None, the windowed layers or None for every layer), as transformers 5.24 applies
    them: ``sliding_window`` on every layer of Mistral, Mixtral and Qwen3-MoE; on the layers whose
    ``layer_types`` entry is "sliding_attention" in Qwen3, Qwen2-MoE and GPT-OSS; refused elsewhere."""
    t, size = cfg.model_type, getattr(cfg, "sliding_window", None)
    kinds = list(getattr(cfg, "layer_types", None) or [])
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise refuse("layer_types", unknown, "layers other than full and sliding-window attention")
    if t in WINDOW_BY_LAYER_TYPES:
        if "sliding_attention" not in kinds:
            return None, None
        if not size:
            raise refuse("sliding_window", size, "sliding-window layers without a window")
        pattern = tuple(int(kind == "sliding_attention") for kind in kinds)
        return int(size), None if all(pattern) else pattern
    if "sliding_attention" in kinds:
        raise refuse("layer_types", kinds, "sliding-window layers outside Qwen3, Qwen2-MoE and GPT-OSS")
    if size in (None, 0):
        return None, None
    if t not in WINDOW_EVERY_LAYER:
        raise refuse("sliding_window", size, "sliding-window attention outside Mistral, Mixtral and Qwen")
    return int(size), None


LATENT_NORM_EPS = 1e-6   # transformers' DeepSeek q_a_layernorm / kv_a_layernorm (fixed; Megatron: layernorm_epsilon)


def _mla(cfg: Any) -> dict:
    """DeepSeek's multi-latent attention in Megatron's names (``HFArchitecture.mla``); its rotated
    dimensions interleaved in pairs: always in DeepSeek-V2 (complex rotation), by ``rope_interleave`` in V3."""
    sizes = dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=int(cfg.kv_lora_rank), qk_head_dim=int(cfg.qk_nope_head_dim),
                 qk_pos_emb_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim))
    interleaved = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
    return dict(mla=sizes, rope_interleave=interleaved)


def _deepseek_routed(cfg: Any, common: dict, refuse: Any) -> HFArchitecture:
    """DeepSeek-V3's and GLM-4.5's MoE: sigmoid scores plus ``e_score_correction_bias`` choose the experts
    within the token's best ``topk_group`` of ``n_group`` groups (a group's score: its two best), the gates
    are the chosen scores (renormalised iff ``norm_topk_prob``) times ``routed_scaling_factor``; ungated
    shared experts of ``n_shared_experts x moe_intermediate_size``; layers before ``first_k_dense_replace``
    dense. DeepSeek-V2: softmax scores, no bias, the gates not renormalised; groups only with ``topk_method``
    ``group_limited_greedy``, each ranked by its best score."""
    experts, groups, best = int(cfg.n_routed_experts), int(cfg.n_group or 1), int(cfg.topk_group or 1)
    first = int(cfg.first_k_dense_replace or 0)
    layers = tuple(range(first, cfg.num_hidden_layers))
    if not layers:
        raise refuse("first_k_dense_replace", first, "no MoE layer left")
    if experts % groups or not 1 <= best <= groups:
        raise refuse("n_group", groups, f"groups that divide n_routed_experts ({experts}) with topk_group ({best}) "
                     "of them")
    limited = groups > 1 and best < groups   # otherwise every group is kept: no limit
    v2 = cfg.model_type == "deepseek_v2"
    if v2:
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise refuse("topk_method", method, "DeepSeek-V2 routing other than greedy and group_limited_greedy")
        limited = limited and method == "group_limited_greedy"
    shared = int(cfg.n_shared_experts or 0) * int(cfg.moe_intermediate_size)
    return HFArchitecture(**common, moe_layers=layers, num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                          normalize_gates=not v2 and bool(cfg.norm_topk_prob),
                          expert_ffn_hidden_size=int(cfg.moe_intermediate_size),
                          shared_ffn_hidden_size=shared, shared_gate=False,
                          score_function="softmax" if v2 else "sigmoid",
                          gate_scale=float(cfg.routed_scaling_factor), router_groups=groups if limited else None,
                          group_topk=best if limited else None, router_bias=not v2,
                          group_score="max" if v2 and limited else "top2_sum")
