"""dots.llm1: GLM-4.5's and DeepSeek-V3's routing (sigmoid, e_score_correction_bias, groups, routed
scaling, ungated shared experts, the first layers dense) with Qwen3's attention (QK-norm per head,
windows by layer_types, no use_sliding_window switch); attention_bias (q/k/v and o) refused."""
from moe_plugin.interop.families.base import DeepSeekStyle
from moe_plugin.interop.families.blocks import MoEBlock, Router, SharedExpert


class Dots1(DeepSeekStyle):
    model_type, architecture, config_class = "dots1", "Dots1ForCausalLM", "Dots1Config"
    title, order = "dots.llm1", 84
    checkpoints = "dots.llm1"
    sets = ("routing as GLM-4.5's (sigmoid, `e_score_correction_bias`, `n_group` / `topk_group`, "
            "`routed_scaling_factor`, `norm_topk_prob`, ungated `n_shared_experts`, `first_k_dense_replace`); "
            "attention as Qwen3's (QK-norm per head, `head_dim`, `layer_types` sliding windows). Refused: "
            "`attention_bias` (biases on q/k/v and o, which would put biases on the dense layers' MLP in "
            "Megatron)")
    window = "layer_types"
    extra_layers = False
    qk_norm = True
    mlp = MoEBlock(router=Router(correction_bias="gate.e_score_correction_bias"),
                   shared=SharedExpert("shared_experts"))


FAMILY = Dots1()
