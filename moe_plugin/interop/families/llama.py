"""Llama: the dense decoder every family's attention and norms follow (upcycling's source)."""
from moe_plugin.interop.families.base import Family


class Llama(Family):
    model_type, architecture, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    title, order = "Llama", 100
    sets = ("dense: the example's `--dense` model; then `moe-plugin upcycle`")
    moe = False
    infer_rank = 99

    def config_fields(self, arch, common):
        return dict(attention_bias=False, mlp_bias=False)

    def infers(self, features):
        return not features["moe"]


FAMILY = Llama()
