"""ERNIE-4.5-MoE: softmax over the experts, the correction bias (``moe_statics``, [1, E]) added to the
probabilities for the choice (``expert_bias_on`` scores), the k gates renormalised (``moe_norm_min``
bounds the sum from below: the same gates unless the chosen probabilities sum under it); ungated
shared experts; MoE layers from moe_layer_start_index to moe_layer_end_index every moe_layer_interval;
RoPE over interleaved pairs (the import moves each head's query and key rows to halves); tied
embeddings by default. ``use_bias`` (biases on every linear and lm_head) refused."""
from moe_plugin.configs import ConfigError
from moe_plugin.interop.families.base import Family, routed
from moe_plugin.interop.families.blocks import Attention, MoEBlock, Router, SharedExpert


def moe_layers(start: int, end: int, interval: int, num_layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)


class Ernie45Moe(Family):
    model_type, architecture, config_class = "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig"
    title, order = "ERNIE-4.5-MoE", 86
    checkpoints = "ERNIE-4.5-21B-A3B, 300B-A47B"
    sets = ("router `topk`, softmax over the experts with the correction bias "
            "(`moe_statics.e_score_correction_bias` [1, E], the router's `expert_bias`) added to the "
            "probabilities for the choice (`expert_bias_on` scores), the k gates renormalised (`moe_norm_min` "
            "bounds their sum from below: the same gates unless the chosen probabilities sum under 1e-12); "
            "`moe_num_shared_experts` x `moe_intermediate_size` one ungated shared expert; MoE layers from "
            "`moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval` (`moe.layers`); RoPE "
            "over interleaved pairs: the import moves each head's query and key rows to the halves Megatron "
            "rotates (a row permutation, cut back on export: the logits agree to summation order, 1e-6); tied "
            "embeddings (its default). Refused: `use_bias` (biases on every linear and `lm_head`). Not read: the "
            "hub's `mtp` tensors")
    shared = "ungated"
    attention = Attention(rope_pairs="interleaved")
    mlp = MoEBlock(router=Router(correction_bias="moe_statics.e_score_correction_bias", bias_as_row=True),
                   shared=SharedExpert("shared_experts"))

    def check(self, cfg, refuse):
        if getattr(cfg, "use_bias", False):
            raise refuse("use_bias", True, "biases on every linear layer and lm_head (Megatron's GPT output layer "
                         "has none)")

    def moe_of(self, cfg, refuse):
        layers = moe_layers(cfg.moe_layer_start_index, cfg.moe_layer_end_index, cfg.moe_layer_interval,
                            cfg.num_hidden_layers)
        shared = int(cfg.moe_num_shared_experts or 0) * int(cfg.moe_intermediate_size)
        return routed(cfg.moe_num_experts, layers, cfg, refuse, normalize_gates=True,
                      expert_ffn_hidden_size=int(cfg.moe_intermediate_size), shared_ffn_hidden_size=shared,
                      router_bias=True, expert_bias_on="scores")

    def moe_keys(self):
        return {"num_experts": "moe_num_experts", "top_k": "moe_k",
                "normalize_gates": "the router (ERNIE-4.5 renormalises)",
                "expert_bias_on": "moe_statics (added to the probabilities for the choice)",
                "shared_expert_ffn_hidden_size": "moe_num_shared_experts x moe_intermediate_size",
                "shared_expert_gate": "(the shared experts are not gated)",
                "layers": "moe_layer_start_index / moe_layer_end_index / moe_layer_interval"}

    def router_checks(self, moe):
        return (("score_function", "softmax"), ("normalize_gates", True), ("gate_scale", 1.0), ("group_topk", None),
                ("activation", "swiglu"), ("expert_linear_bias", False), ("router_logit_bias", False),
                ("expert_bias_on", "scores"))

    def config_fields(self, arch, common):
        L, layers, imported = arch.num_layers, arch.moe_layers, arch.config or {}
        recorded = tuple(imported.get(f"moe_layer_{k}") for k in ("start_index", "end_index", "interval"))
        candidates = ([recorded] if all(isinstance(v, int) and v > 0 for v in recorded[2:]) else []) + [
            (layers[0], layers[-1], n) for n in range(1, L + 1)]   # the imported rule first, as written
        rule = next((c for c in candidates if moe_layers(*c, L) == layers), None)
        if rule is None:
            raise ConfigError("moe.layers", list(layers), f"{self.title} cannot express it: MoE layers from "
                              "moe_layer_start_index to moe_layer_end_index every moe_layer_interval")
        start, end, interval = rule
        return dict(moe_num_experts=arch.num_experts, moe_k=arch.top_k, moe_intermediate_size=arch.expert_ffn_hidden_size,
                    moe_num_shared_experts=arch.shared_ffn_hidden_size // arch.expert_ffn_hidden_size,
                    moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval, use_bias=False)


FAMILY = Ernie45Moe()
