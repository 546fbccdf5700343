"""MiniMax-M2: sigmoid scores with e_score_correction_bias (on the MoE block) for the choice, the k
gates always renormalised, no scaling, groups or shared experts; every layer MoE (Mixtral's names);
QK-norm over the whole query and key projections with grouped-query heads; partial rotary
(``rotary_dim``); ``sliding_window`` ignored, as transformers ignores it."""
from moe_plugin.interop.families.base import Family, every_layer, partial_rope, routed
from moe_plugin.interop.families.blocks import Experts, MoEBlock, Router

SIGMOID_ROUTER = (("score_function", "sigmoid"), ("normalize_gates", True), ("gate_scale", 1.0),
                  ("group_topk", None), ("activation", "swiglu"), ("expert_linear_bias", False),
                  ("router_logit_bias", False))


class MiniMaxM2(Family):
    model_type, architecture, config_class = "minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config"
    title, order = "MiniMax-M2", 82
    checkpoints = "MiniMax-M2"
    sets = ("every layer MoE: router `topk` with `score_function` sigmoid, `e_score_correction_bias` (on the MoE "
            "block, `block_sparse_moe.e_score_correction_bias`) the router's `expert_bias` for the choice, the k "
            "gates always renormalised, no scaling, groups or shared experts; experts `w1`/`w3`/`w2` as "
            "Mixtral's, sized by `intermediate_size`; QK-norm over the whole query and key projections "
            "(`--qk-layernorm-scope projection`, as OLMoE's, here with grouped-query heads and `head_dim`); "
            "partial rotary (`rotary_dim` / `partial_rotary_factor`: `--rotary-percent`). `sliding_window` is "
            "ignored, as transformers' model applies none")
    window = "ignored"
    partial_rotary = True
    expert_ffn_key = "intermediate_size"
    qk_norm, qk_scope = True, "projection"
    layers = "every"
    mlp = MoEBlock("block_sparse_moe", router=Router(correction_bias="e_score_correction_bias"),
                   experts=Experts(("w1", "w3", "w2")))

    def moe_of(self, cfg, refuse):
        return routed(cfg.num_local_experts, every_layer(cfg), cfg, refuse, normalize_gates=True,
                      expert_ffn_hidden_size=int(cfg.intermediate_size), score_function="sigmoid", router_bias=True)

    def moe_keys(self):
        return {"num_experts": "num_local_experts", "normalize_gates": "the router (MiniMax-M2 renormalises)"}

    def router_checks(self, moe):
        return SIGMOID_ROUTER

    def config_fields(self, arch, common):
        rope = partial_rope(arch, common["rope_parameters"])
        return dict(num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                    intermediate_size=arch.expert_ffn_hidden_size, rope_parameters=rope, router_jitter_noise=0.0)


FAMILY = MiniMaxM2()
