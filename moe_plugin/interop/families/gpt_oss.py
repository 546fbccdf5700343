"""GPT-OSS: a softmax over the top-k logits (the top-k of a softmax, renormalised) with the router's
logit bias; every layer MoE; the experts' clamped SwiGLU with biases, fused as [E, H, 2F] with gate
and up interleaved (MXFP4 blocks dequantized at import); biases on q/k/v and o_proj; attention sinks;
sliding and full layers by layer_types; YaRN."""
from moe_plugin.interop.families.base import Family, every_layer, routed
from moe_plugin.interop.families.blocks import FusedExperts, MoEBlock, Router


class GptOss(Family):
    model_type, architecture, config_class = "gpt_oss", "GptOssForCausalLM", "GptOssConfig"
    title, order = "GPT-OSS", 80
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
