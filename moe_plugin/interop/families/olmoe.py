"""OLMoE: softmax, top-k, renormalised iff norm_topk_prob (default false); every layer MoE; QK-norm
as one RMSNorm over the whole query and key projections (all heads at once); clip_qkv refused."""
from moe_plugin.interop.families.base import Family, every_layer, routed
from moe_plugin.interop.families.blocks import MoEBlock


class Olmoe(Family):
    model_type, architecture, config_class = "olmoe", "OlmoeForCausalLM", "OlmoeConfig"
    title, order = "OLMoE", 40
    sets = ("as Mixtral on every layer, `normalize_gates` = `norm_topk_prob` (false in OLMoE); "
            "`intermediate_size` the experts' FFN; QK-norm as one RMSNorm over the whole query and the whole key "
            "projection, all heads at once (`--qk-layernorm --qk-layernorm-scope projection`: its mean square "
            "summed over TP ranks, its weight `q_norm` [heads x head size] split over TP by head); refused: "
            "`clip_qkv`, `attention_bias`")
    expert_ffn_key = "intermediate_size"
    qk_norm, qk_scope = True, "projection"
    layers = "every"
    infer_rank = 50
    mlp = MoEBlock()

    def moe_of(self, cfg, refuse):
        return routed(cfg.num_experts, every_layer(cfg), cfg, refuse, normalize_gates=bool(cfg.norm_topk_prob),
                      expert_ffn_hidden_size=int(cfg.intermediate_size))

    def config_fields(self, arch, common):
        return dict(num_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                    intermediate_size=arch.expert_ffn_hidden_size, norm_topk_prob=arch.normalize_gates,
                    clip_qkv=None, attention_bias=False)

    def infers(self, features):
        return features["moe"] and features["qk"] and features["qk_scope"] == "projection"


FAMILY = Olmoe()
