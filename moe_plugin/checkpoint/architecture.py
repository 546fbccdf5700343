"""Whether the running model is built like the one a checkpoint records (``architecture`` in its metadata).

A checkpoint of ``moe-plugin import-hf`` records the imported architecture's ``TransformerConfig``
fields and ``GPTModel`` arguments and the example's flags that set them: shapes alone do not tell RoPE
from learned positions, RMSNorm from LayerNorm without biases, or two norm epsilons apart.
``architecture_problems`` names each field that differs and its flag. Checkpoints without the record
are compared on their ``"model"`` record (``metadata.architecture_differences``).
"""
from __future__ import annotations

from typing import Any

# TransformerConfig field / GPTModel argument -> the example's (Megatron-LM's) flag
FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
         "num_query_groups": "--group-query-attention --num-query-groups", "kv_channels": "--kv-channels",
         "ffn_hidden_size": "--ffn-hidden-size", "normalization": "--normalization",
         "layernorm_epsilon": "--norm-epsilon", "gated_linear_unit": "--swiglu", "activation_func": "--swiglu",
         "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
         "qk_layernorm": "--qk-layernorm", "position_embedding_type": "--position-embedding-type",
         "rotary_base": "--rotary-base", "tied": "--untie-embeddings-and-output-weights",
         "qk_layernorm_scope": "--qk-layernorm-scope", "rotary_percent": "--rotary-percent",
         "rope_scaling": "--rope-scaling", "window_size": "--window-size",
         "window_attn_skip_freq": "--window-attn-skip-freq", "multi_latent_attention": "--multi-latent-attention",
         "q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim",
         "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim", "softmax_type": "--softmax-type"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def architecture_problems(meta: dict, running: dict) -> list[str]:
    """One line per recorded architecture field that the running model has otherwise."""
    record = meta.get("architecture")
    if not record:
        return []
    config = running.get("transformer_config", {})
    mine = {**{k: config.get(k) for k in record.get("transformer_config", {})},
            "position_embedding_type": running.get("position_embedding_type", "learned_absolute"),
            "rotary_base": running.get("rotary_base"), "tied": running.get("tied"),
            "qk_layernorm_scope": running.get("qk_layernorm_scope", "head"),
            "rotary_percent": running.get("rotary_percent", 1.0), "rope_scaling": running.get("rope_scaling")}
    wanted = {**record.get("transformer_config", {}), **record.get("model", {})}
    return [f"{key} is {wanted[key]!r} in the checkpoint but {mine.get(key)!r} in the model (the example's "
            f"{FLAGS.get(key, key)}; the checkpoint's flags: {' '.join(record.get('flags', []))})"
            for key in wanted if key in mine and not _same(wanted[key], mine[key])
            and not (key == "rotary_base" and wanted.get("position_embedding_type") != "rope")]
