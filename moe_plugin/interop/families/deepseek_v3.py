"""DeepSeek-V3: GLM-4.5's routing with multi-latent attention (Megatron's MLASelfAttention, whose latent
norms transformers fixes at epsilon 1e-6); rope_interleave false: the import interleaves the rotated rows."""
from moe_plugin.interop.families.base import DeepSeekStyle
from moe_plugin.interop.families.blocks import LatentAttention, MoEBlock, Router, SharedExpert


def latent_sizes(cfg):
    """Multi-latent attention's sizes in Megatron's names."""
    return dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=int(cfg.kv_lora_rank), qk_head_dim=int(cfg.qk_nope_head_dim),
                qk_pos_emb_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim))


def latent_config(arch):
    m = arch.mla
    return dict(q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"], qk_nope_head_dim=m["qk_head_dim"],
                qk_rope_head_dim=m["qk_pos_emb_head_dim"], v_head_dim=m["v_head_dim"], head_dim=m["qk_pos_emb_head_dim"])


class DeepseekV3(DeepSeekStyle):
    model_type, architecture, config_class = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config"
    title, order = "DeepSeek-V3", 60
    mla = True
    qk_norm = True
    infer_rank = 20
    attention = LatentAttention()
    mlp = MoEBlock(router=Router(correction_bias="gate.e_score_correction_bias"),
                   shared=SharedExpert("shared_experts"))

    def mla_of(self, cfg):
        return dict(mla=latent_sizes(cfg), rope_interleave=bool(getattr(cfg, "rope_interleave", True)))

    def config_fields(self, arch, common):
        return (super().config_fields(arch, common) | dict(num_nextn_predict_layers=0) | latent_config(arch)
                | dict(rope_interleave=arch.rope_interleave))

    def infers(self, features):
        return features["moe"] and features["mla"] and features["score_function"] == "sigmoid"


FAMILY = DeepseekV3()
