"""DeepSeek-V2: DeepSeek-V3's attention (its rotated pairs always interleaved); softmax scores, no
correction bias, the gates not renormalised, times routed_scaling_factor; topk_method
group_limited_greedy: the groups ranked by their best score; greedy: no limit."""
from moe_plugin.interop.families.base import DeepSeekStyle, deepseek_routed
from moe_plugin.interop.families.blocks import LatentAttention, MoEBlock, SharedExpert
from moe_plugin.interop.families.deepseek_v3 import latent_config, latent_sizes


class DeepseekV2(DeepSeekStyle):
    model_type, architecture, config_class = "deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config"
    title, order = "DeepSeek-V2", 70
    checkpoints = "V2, V2-Lite, Coder-V2"
    sets = ("multi-latent attention as V3's (`q_lora_rank` null in V2-Lite: `q_proj` is `linear_q_proj`); the "
            "rotation always interleaved (complex); softmax scores, the gates not renormalised, times "
            "`routed_scaling_factor`; `topk_method` `group_limited_greedy`: `n_group` / `topk_group` with each "
            "group ranked by its best score (`group_score` max), `greedy`: no limit (other methods refused); "
            "`n_shared_experts`; `first_k_dense_replace`. Refused: `attention_bias`, `mlp_bias`, `rms_norm_eps` "
            "other than 1e-6")
    mla = True
    qk_norm = True
    infer_rank = 21
    attention = LatentAttention()
    mlp = MoEBlock(shared=SharedExpert("shared_experts"))

    def moe_of(self, cfg, refuse):
        return deepseek_routed(cfg, refuse, v2=True)

    def mla_of(self, cfg):
        return dict(mla=latent_sizes(cfg), rope_interleave=True)

    def moe_keys(self):
        return super().moe_keys() | {"normalize_gates": "the router (DeepSeek-V2 does not renormalise)"}

    def router_checks(self, moe):   # softmax, unnormalised gates; any scale; groups ranked by their best
        return (("score_function", "softmax"), ("normalize_gates", False), ("activation", "swiglu"),
                ("group_score", "max" if moe.get("group_topk") else "top2_sum"),
                ("expert_linear_bias", False), ("router_logit_bias", False))

    def config_fields(self, arch, common):
        return (super().config_fields(arch, common) | latent_config(arch)
                | dict(topk_method="group_limited_greedy" if arch.group_topk else "greedy", mlp_bias=False))

    def infers(self, features):
        return features["moe"] and features["mla"]


FAMILY = DeepseekV2()
