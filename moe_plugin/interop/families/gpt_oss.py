"""GPT-OSS: a softmax over the top-k logits (the top-k of a softmax, renormalised) with the router's
logit bias; every layer MoE; the experts' clamped SwiGLU with biases, fused as [E, H, 2F] with gate
and up interleaved (MXFP4 blocks dequantized at import); biases on q/k/v and o_proj; attention sinks;
sliding and full layers by layer_types; YaRN."""
from moe_plugin.interop.families.base import Family, every_layer, routed
from moe_plugin.interop.families.blocks import FusedExperts, MoEBlock, Router


class GptOss(Family):
    model_type, architecture, config_class = "gpt_oss", "GptOssForCausalLM", "GptOssConfig"
    title, order = "GPT-OSS", 80
    checkpoints = "gpt-oss-20b, -120b"
    sets = ("every layer MoE: router `topk` over a softmax of the top-k logits (the top-k of a softmax, "
            "renormalised) with the router's logit bias (`router_logit_bias`: `mlp.router.bias`, which the choice"
            " and the gates both see); experts `activation` `clamped_swiglu` (`swiglu_alpha` 1.702, "
            "`swiglu_limit` 7: the gate clamped above, the up half both sides, `(up + 1) * gate * sigmoid(alpha *"
            " gate)`) with biases (`expert_linear_bias`: `gate_up_proj_bias`, `down_proj_bias`); the experts "
            "fused in the hub's layout (`experts.gate_up_proj` [E, H, 2F] with gate and up interleaved, "
            "`experts.down_proj` [E, F, H]): read one expert's row at a time, the gate and up columns "
            "de-interleaved into the plugin's halves, written back fused; MXFP4 experts (`quantization_config` "
            "mxfp4: `gate_up_proj_blocks`/`_scales`, `down_proj_blocks`/`_scales`) dequantized at import, one "
            "expert's row of blocks at a time (FP4 values times their block's power of two, in the config's "
            "dtype, bfloat16 for the hub's); `attention_bias`: biases on q/k/v and o_proj (Megatron's "
            "`add_bias_linear`: no `--disable-bias-linear`); `sinks` the learned softmax offset per head "
            "(`--softmax-type learnable`, `core_attention.softmax_offset`); `layer_types` sliding / full with "
            "`sliding_window` (`--window-size W-1,0 --window-attn-skip-freq [1,0,...]`); `head_dim` "
            "(`--kv-channels`); YaRN with `truncate` false. Refused: other `layer_types`, other quantizations. "
            "Ignored as by the other families: `router_aux_loss_coef` (the \"moe\" block's `aux_loss_coeff` is the "
            "user's). The export writes the checkpoint's dtype (bf16 for an import of the hub's model), "
            "unquantized")
    window = "layer_types"
    attention_bias = True
    quantized = ("mxfp4",)
    expert_ffn_key = "intermediate_size"
    qkv_bias = linear_bias = sinks = True
    layers = "every"
    infer_rank = 10
    mlp = MoEBlock(router=Router("router"), experts=FusedExperts())

    def attention_of(self, cfg):
        bias = bool(getattr(cfg, "attention_bias", False))
        return super().attention_of(cfg) | dict(qkv_bias=bias, linear_bias=bias)

    def moe_of(self, cfg, refuse):
        return routed(cfg.num_local_experts, every_layer(cfg), cfg, refuse, normalize_gates=True,
                      expert_ffn_hidden_size=int(cfg.intermediate_size), activation="clamped_swiglu",
                      swiglu_alpha=float(cfg.swiglu_alpha), swiglu_limit=float(cfg.swiglu_limit),
                      expert_linear_bias=True, router_logit_bias=True)

    def moe_keys(self):
        return {"num_experts": "num_local_experts", "activation": "the experts (a clamped SwiGLU)",
                "expert_linear_bias": "the experts' gate_up_proj_bias and down_proj_bias",
                "router_logit_bias": "the router's bias"}

    def router_checks(self, moe):   # its experts and router: their biases always there
        return (("score_function", "softmax"), ("gate_scale", 1.0), ("group_topk", None), ("normalize_gates", True),
                ("activation", "clamped_swiglu"), ("expert_linear_bias", True), ("router_logit_bias", True))

    def config_fields(self, arch, common):
        return dict(num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                    intermediate_size=arch.expert_ffn_hidden_size, swiglu_alpha=arch.swiglu_alpha,
                    swiglu_limit=arch.swiglu_limit, attention_bias=True, sliding_window=None,
                    layer_types=["full_attention"] * arch.num_layers)

    def infers(self, features):
        return features["moe"] and features["activation"] == "clamped_swiglu"


FAMILY = GptOss()
