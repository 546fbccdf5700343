"""dots.llm1: GLM-4.5's and DeepSeek-V3's routing (sigmoid, e_score_correction_bias, groups, routed
scaling, ungated shared experts, the first layers dense) with Qwen3's attention (QK-norm per head,
windows by layer_types, no use_sliding_window switch); attention_bias (q/k/v and o) refused."""
from moe_plugin.interop.families.base import DeepSeekStyle
from moe_plugin.interop.families.blocks import MoEBlock, Router, SharedExpert


class Dots1(DeepSeekStyle):
    model_type, architecture, config_class = "dots1", "Dots1ForCausalLM", "Dots1Config"
    title, order = "dots.llm1", 84
    window = "layer_types"
    extra_layers = False
    qk_norm = True
    mlp = MoEBlock(router=Router(correction_bias="gate.e_score_correction_bias"),
                   shared=SharedExpert("shared_experts"))


FAMILY = Dots1()
