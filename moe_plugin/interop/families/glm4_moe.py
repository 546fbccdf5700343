"""GLM-4.5: DeepSeek-style routing (sigmoid scores, e_score_correction_bias for the choice, groups,
routed scaling, ungated shared experts, the first layers dense); QKV biases (attention_bias), QK-norm
per head by use_qk_norm, partial rotary; the MTP layers' tensors left out."""
from moe_plugin.interop.families.base import DeepSeekStyle
from moe_plugin.interop.families.blocks import MoEBlock, Router, SharedExpert


class Glm4Moe(DeepSeekStyle):
    model_type, architecture, config_class = "glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"
    title, order = "GLM-4.5", 50
    partial_rotary = True
    attention_bias = qkv_bias = True
    qk_norm = None
    infer_rank = 30
    mlp = MoEBlock(router=Router(correction_bias="gate.e_score_correction_bias"),
                   shared=SharedExpert("shared_experts"))

    def attention_of(self, cfg):
        return super().attention_of(cfg) | dict(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                                qk_layernorm=bool(getattr(cfg, "use_qk_norm", False)))

    def config_fields(self, arch, common):
        return super().config_fields(arch, common) | dict(num_nextn_predict_layers=0, use_qk_norm=arch.qk_layernorm)

    def infers(self, features):
        return features["moe"] and features["score_function"] == "sigmoid"


FAMILY = Glm4Moe()
