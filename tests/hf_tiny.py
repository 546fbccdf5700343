"""Tiny random Hugging Face models built with transformers' own classes (no download), for the
import/export tests: 2 layers, hidden 64, 4 heads over 2 key/value groups, 8 experts top-2, vocab 384
(the example's byte-level data: 257 token ids padded to a multiple of 128).

    dirs = save_tiny_models(tmp_path)     # {"mixtral": path, "qwen3_moe": ..., "llama": ..., "qwen3": ..., ...}
    logits = hf_logits(dirs["mixtral"], tokens_BS)

The weights are drawn with std 0.2 (``initializer_range``), not transformers' 0.02, so that the
routers' choices and the logits are far from uniform: a wrong gate or a swapped head would show.
"""
from __future__ import annotations

import os

import torch

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 384, 64, 2, 8, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-5)
# name -> (transformers config class, model class, the config's own fields)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",   # QK-norm, renormalised gates, heads of 32 (not 16)
                  dict(moe_intermediate_size=32, intermediate_size=96, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       norm_topk_prob=True, head_dim=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",   # shared expert, QKV bias, unnormalised gates
                  dict(moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
                       num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",   # QK-norm over the whole projections, unnormalised gates
              dict(intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False,
                   eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3_moe_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",   # YaRN: 4x an original context of 8 tokens
                       dict(moe_intermediate_size=32, intermediate_size=96, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True, head_dim=32, max_position_embeddings=32,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 8})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",   # sigmoid + correction bias, 2 of 4 groups, scaled gates,
                 dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=EXPERTS,   # a dense layer 0,
                      num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=4, topk_group=2,      # a shared expert,
                      routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,     # QKV bias, QK-norm,
                      attention_bias=True, use_qk_norm=True,                                       # half the head rotated
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",   # multi-latent attention (interleaved RoPE) with
                    dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=EXPERTS,   # YaRN (its mscales
                         num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=4, topk_group=2,      # set the softmax
                         routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,     # scale and the
                         q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,    # cos/sin factor),
                         v_head_dim=12, num_key_value_heads=4, max_position_embeddings=32,            # DeepSeek-V3
                         rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,  # routing
                                          "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8,
                                          "beta_fast": 32, "beta_slow": 1})),
    "deepseek_v3_halves": ("DeepseekV3Config", "DeepseekV3ForCausalLM",   # RoPE over (i, i + r/2) pairs, plain RoPE
                           dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=1, topk_group=1,
                                first_k_dense_replace=0, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4, rms_norm_eps=1e-6,
                                rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",   # V2-Lite's full query projection, softmax
                    dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=EXPERTS,   # group_limited_
                         num_experts_per_tok=TOP_K, n_shared_experts=2, n_group=4, topk_group=2,      # greedy, scaled
                         topk_method="group_limited_greedy", routed_scaling_factor=1.5,               # unnormalised
                         first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,                  # gates
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM",   # a sliding window of 6 on every layer
                       dict(intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",   # attention sinks, biases on q/k/v/o, router and experts,
                dict(intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,   # the clamped
                     head_dim=24, swiglu_limit=1.0, sliding_window=4, max_position_embeddings=32,  # SwiGLU (limit 1:
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,   # it cuts), fused
                                      "original_max_position_embeddings": 8, "beta_fast": 32.0,    # experts, a window
                                      "beta_slow": 1.0, "truncate": False})),                      # of 4 then full
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",   # sigmoid + the block's correction bias, always
                   dict(intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,   # renormalised;
                        head_dim=32, rotary_dim=16, bos_token_id=None, eos_token_id=None,   # QK-norm over the
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6})),      # projections (GQA, heads
    #                                                     of 32, not 16), half the head rotated (the hub's rotary_dim)
    "dots1": ("Dots1Config", "Dots1ForCausalLM",   # GLM-4.5's routing (2 of 4 groups, x2.5, renormalised), 2 shared
              dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=EXPERTS,   # experts, layer 0
                   num_experts_per_tok=TOP_K, n_shared_experts=2, n_group=4, topk_group=2,     # dense, QK-norm per
                   routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,    # head of 32, layer 1
                   head_dim=32, sliding_window=4, max_window_layers=1, attention_bias=False)),  # a window of 4
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",   # softmax, its bias on the probabilities,
                     dict(intermediate_size=64, moe_intermediate_size=32, moe_num_experts=EXPERTS,   # renormalised;
                          moe_k=TOP_K, moe_num_shared_experts=2, num_hidden_layers=4,   # 2 shared experts; MoE layers
                          moe_layer_start_index=0, moe_layer_end_index=3, moe_layer_interval=2,   # 1 and 3 of 4 (a
                          use_bias=False)),   # dense one between them); interleaved RoPE; tied embeddings (its default)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",   # dense: QK-norm, heads of 32 (not 16), untied
              dict(intermediate_size=64, head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",   # dense, untied; its default window is 4096
                dict(intermediate_size=64, sliding_window=None, tie_word_embeddings=False)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM",   # dense, a sliding window of 5
                       dict(intermediate_size=64, sliding_window=5, tie_word_embeddings=False)),
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM",   # dense: layer 0 full, layer 1 a window of 4
                     dict(intermediate_size=64, head_dim=32, tie_word_embeddings=False, use_sliding_window=True,
                          sliding_window=4, max_window_layers=1)),
}


def tiny_config(name: str, **overrides):
    import transformers

    config_cls, _model_cls, fields = MODELS[name]
    return getattr(transformers, config_cls)(**{**COMMON, **fields, **overrides})


def save_tiny_model(name: str, path: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> str:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, MODELS[name][1])(tiny_config(name, **overrides))
    for module in model.modules():   # GLM-4.5's routers: a correction bias that changes choices (it starts at 0)
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape) * 0.1)
        for name in ("gate_up_proj_bias", "down_proj_bias"):   # GPT-OSS's expert biases (they start at 0)
            if hasattr(module, name):
                getattr(module, name).data.copy_(torch.randn(getattr(module, name).shape) * 0.2)
    model.to(dtype).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def tiny_tokenizer():
    """A word-level tokenizer of VOCAB tokens (tokenizer.json, tokenizer_config.json, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def save_tiny_models(root) -> dict[str, str]:
    return {name: save_tiny_model(name, os.path.join(str(root), name), seed=i) for i, name in enumerate(MODELS)}


def hf_logits(path: str, tokens_BS: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [B, S, V] of the model in ``path`` (eval, no cache)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens_BS, use_cache=False).logits.float()


def import_tiny(root) -> dict:
    """A tiny Mixtral (with its tokenizer) under ``root/mixtral``, imported as ``moe-plugin import-hf``
    imports it into ``root/ckpt``, and a DeepSpeed JSON ``root/ds.json`` to import it with."""
    import json
    from pathlib import Path

    from moe_plugin.interop import import_hf

    root = Path(root)
    hf = Path(save_tiny_model("mixtral", str(root / "mixtral")))
    import_hf(hf, {"moe": {"num_experts": EXPERTS}}, root / "ckpt", progress=lambda line: None)
    (root / "ds.json").write_text(json.dumps({"train_batch_size": 8, "moe": {"num_experts": EXPERTS}}))
    return {"hf": hf, "ckpt": root / "ckpt", "config": root / "ds.json"}
