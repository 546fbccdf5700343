"""Mixtral: softmax over the experts, top-k, the k gates always renormalised; every layer MoE
(``block_sparse_moe``, experts w1/w3/w2); a sliding window on every layer."""
from moe_plugin.interop.families.base import Family, every_layer, routed
from moe_plugin.interop.families.blocks import Experts, MoEBlock


class Mixtral(Family):
    model_type, architecture, config_class = "mixtral", "MixtralForCausalLM", "MixtralConfig"
    title, order = "Mixtral", 10
    sets = ("router `topk`, softmax over the experts, the k gates renormalised")
    window = "every_layer"
    expert_ffn_key = "intermediate_size"
    layers = "every"
    infer_rank = 99
    mlp = MoEBlock("block_sparse_moe", experts=Experts(("w1", "w3", "w2")))

    def moe_of(self, cfg, refuse):
        return routed(cfg.num_local_experts, every_layer(cfg), cfg, refuse, normalize_gates=True,
                      expert_ffn_hidden_size=int(cfg.intermediate_size))

    def moe_keys(self):
        return {"num_experts": "num_local_experts",
                "normalize_gates": "the router (Mixtral renormalises the top-k gates)"}

    def check_router(self, moe, refuse):
        if not moe.get("normalize_gates", True):
            raise refuse("moe.normalize_gates", False, "the top-k gates renormalised to sum 1 (Mixtral always does)")

    def config_fields(self, arch, common):
        return dict(num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                    intermediate_size=arch.expert_ffn_hidden_size, sliding_window=None, router_jitter_noise=0.0)

    def infers(self, features):
        return features["moe"]


FAMILY = Mixtral()
