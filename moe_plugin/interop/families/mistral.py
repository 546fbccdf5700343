"""Mistral: dense, a sliding window on every layer."""
from moe_plugin.interop.families.base import Family


class Mistral(Family):
    model_type, architecture, config_class = "mistral", "MistralForCausalLM", "MistralConfig"
    title, order = "Mistral", 110
    sets = ("dense, a sliding window on every layer")
    moe = False
    window = "every_layer"

    def config_fields(self, arch, common):
        return dict(sliding_window=None)


FAMILY = Mistral()
