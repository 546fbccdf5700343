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
    checkpoints = "DeepSeek-V3, R1, V3.1, Kimi K2, Moonlight"
    sets = ("multi-latent attention: Megatron's `MLASelfAttention` (`--multi-latent-attention`; `q_lora_rank` "
            "`--q-lora-rank` with `q_a_layernorm`, `kv_lora_rank` `--kv-lora-rank` with `kv_a_layernorm` (both "
            "`--qk-layernorm`), `qk_nope_head_dim` `--qk-head-dim`, `qk_rope_head_dim` `--qk-pos-emb-head-dim`, "
            "`v_head_dim` `--v-head-dim`; `q_a_proj`/`q_b_proj`/`kv_a_proj_with_mqa`/`kv_b_proj`/`o_proj` are "
            "`linear_q_down_proj`/`linear_q_up_proj`/`linear_kv_down_proj`/`linear_kv_up_proj`/`linear_proj`, the"
            " rotary key shared by the heads); `rope_interleave` true: the hub's weights as they are (Megatron's "
            "MLA rotates the pairs (0, 1), (2, 3) ...), false: the rotated rows interleaved at import and cut "
            "back on export; YaRN's `mscale_all_dim` sets the softmax scale (`mscale^2 / sqrt(qk head)`); routing"
            " as GLM-4.5's (sigmoid, `e_score_correction_bias`, `n_group` / `topk_group`, "
            "`routed_scaling_factor`, `norm_topk_prob`, `n_shared_experts`, `first_k_dense_replace`). Refused: "
            "`attention_bias`, `rms_norm_eps` other than 1e-6 (transformers' latent norms have 1e-6 fixed, "
            "Megatron's the model's epsilon). Dropped with a printed line: the multi-token-prediction layers "
            "(`num_nextn_predict_layers`; Megatron-Core's MTP is not wired into the plugin's model); an export "
            "says `num_nextn_predict_layers` 0")
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
