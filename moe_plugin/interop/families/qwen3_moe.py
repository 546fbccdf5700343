"""Qwen3-MoE: softmax, top-k, renormalised iff norm_topk_prob; QK-norm per head; MoE layers by
decoder_sparse_step and mlp_only_layers; a sliding window on every layer."""
from moe_plugin.interop.families.base import Family, routed, sparse_step_layers
from moe_plugin.interop.families.blocks import MoEBlock


class Qwen3Moe(Family):
    model_type, architecture, config_class = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"
    title, order = "Qwen3-MoE", 20
    sets = ("as Mixtral, `normalize_gates` = `norm_topk_prob`; QK-norm (`--qk-layernorm`); `head_dim` "
            "(`--kv-channels`); dense layers of `mlp_only_layers` / `decoder_sparse_step` (`moe.layers`)")
    window = "every_layer"
    use_sliding_window_key = True
    qk_norm = True
    infer_rank = 60
    mlp = MoEBlock()

    def moe_of(self, cfg, refuse):
        return routed(cfg.num_experts, sparse_step_layers(cfg), cfg, refuse, normalize_gates=bool(cfg.norm_topk_prob),
                      expert_ffn_hidden_size=int(cfg.moe_intermediate_size))

    def config_fields(self, arch, common):
        return qwen_moe_config(arch) | dict(attention_bias=False)

    def infers(self, features):
        return features["moe"] and features["qk"]


def qwen_moe_config(arch):
    dense = [i for i in range(arch.num_layers) if i not in arch.moe_layers]
    return dict(num_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                moe_intermediate_size=arch.expert_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=dense,
                norm_topk_prob=arch.normalize_gates, use_sliding_window=False)


FAMILY = Qwen3Moe()
