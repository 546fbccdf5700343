"""Qwen2-MoE: softmax, top-k, renormalised iff norm_topk_prob; a shared expert (SwiGLU) scaled by
sigmoid(shared_expert_gate(x)); QKV biases (qkv_bias, default true); windows by layer_types."""
from moe_plugin.interop.families.base import Family, routed, sparse_step_layers
from moe_plugin.interop.families.blocks import MoEBlock, SharedExpert
from moe_plugin.interop.families.qwen3_moe import qwen_moe_config


class Qwen2Moe(Family):
    model_type, architecture, config_class = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig"
    title, order = "Qwen2-MoE", 30
    sets = ("as Qwen3-MoE without QK-norm; the shared expert (`shared_expert_ffn_hidden_size`) scaled by "
            "`sigmoid(x . w)` (`shared_expert_gate`); QKV biases (`--add-qkv-bias`)")
    window = "layer_types"
    use_sliding_window_key = True
    qkv_bias = always_qkv_bias = True
    shared = "gated"
    infer_rank = 40
    mlp = MoEBlock(shared=SharedExpert("shared_expert", gate="shared_expert_gate"))

    def attention_of(self, cfg):
        return super().attention_of(cfg) | dict(qkv_bias=bool(getattr(cfg, "qkv_bias", True)))

    def moe_of(self, cfg, refuse):
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return routed(cfg.num_experts, sparse_step_layers(cfg), cfg, refuse, normalize_gates=bool(cfg.norm_topk_prob),
                      expert_ffn_hidden_size=int(cfg.moe_intermediate_size), shared_ffn_hidden_size=shared,
                      shared_gate=shared > 0)

    def moe_keys(self):
        return {"shared_expert_ffn_hidden_size": "shared_expert_intermediate_size",
                "shared_expert_gate": "shared_expert_gate (a sigmoid gate)"}

    def config_fields(self, arch, common):
        return qwen_moe_config(arch) | dict(shared_expert_intermediate_size=arch.shared_ffn_hidden_size, qkv_bias=True)

    def infers(self, features):
        return features["moe"] and features["shared"]


FAMILY = Qwen2Moe()
