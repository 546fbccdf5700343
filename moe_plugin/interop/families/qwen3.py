"""Qwen3: dense, QK-norm per head, windows on the layers layer_types names."""
from moe_plugin.interop.families.base import Family


class Qwen3(Family):
    model_type, architecture, config_class = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"
    title, order = "Qwen3", 120
    sets = ("dense, QK-norm per head, `layer_types` sliding windows")
    moe = False
    window = "layer_types"
    use_sliding_window_key = True
    qk_norm = True
    infer_rank = 50

    def config_fields(self, arch, common):
        return dict(attention_bias=False, sliding_window=None)

    def infers(self, features):
        return not features["moe"] and features["qk"]


FAMILY = Qwen3()
