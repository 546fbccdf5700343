"""GLM-4.5: DeepSeek-style routing (sigmoid scores, e_score_correction_bias for the choice, groups,
routed scaling, ungated shared experts, the first layers dense); QKV biases (attention_bias), QK-norm
per head by use_qk_norm, partial rotary; the MTP layers' tensors left out."""
from moe_plugin.interop.families.base import DeepSeekStyle
from moe_plugin.interop.families.blocks import MoEBlock, Router, SharedExpert


class Glm4Moe(DeepSeekStyle):
    model_type, architecture, config_class = "glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"
    title, order = "GLM-4.5", 50
    checkpoints = "GLM-4.5, 4.6"
    sets = ("router `topk` with `score_function` sigmoid; `e_score_correction_bias` is the router's `expert_bias`"
            " (imported, moved by `bias_update_rate`, exported); `n_group` / `topk_group` the group-limited "
            "choice (`router_groups` / `group_topk`; one group or all groups kept: no limit), a group ranked by "
            "its two best biased scores; `routed_scaling_factor` is `gate_scale`; `norm_topk_prob` "
            "`normalize_gates`; `n_shared_experts` x `moe_intermediate_size` one ungated shared expert "
            "(`shared_expert_ffn_hidden_size`); layers before `first_k_dense_replace` dense (`moe.layers`, "
            "`intermediate_size` theirs); `attention_bias` the QKV biases (`--add-qkv-bias`; o_proj has none); "
            "`use_qk_norm` (`--qk-layernorm`); `partial_rotary_factor` (`--rotary-percent`, Megatron-LM's flag: "
            "the first share of each head rotated). Dropped: the multi-token-prediction layers (`model.layers.N` "
            "past `num_hidden_layers`, which transformers does not load either), with a printed line. Under "
            "pipeline parallelism a stage holding only the dense first layers needs ZeRO-0 (ZeRO-1/2 want MoE "
            "layers on every stage)")
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
