"""A Hugging Face ``config.json``'s values, checked before any work is sized by them.

``read_config_json`` reads it as a sane-sized UTF-8 JSON object; ``check_values`` each size (an
integer in range) and epsilon or scale (finite, positive); ``check_against_headers`` the layers and
embedding against the safetensors headers; ``check_relations`` the sizes against each other;
``check_headers`` and ``check_shapes`` the router and every mapped tensor against the config. Headers
only, so every refusal (``FILE: KEY: got VALUE; what is valid``) comes before anything is written.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from moe_plugin.configs import ConfigError
from moe_plugin.configs.json_text import utf8

MAX_CONFIG_BYTES = 64 << 20   # the hub's config.json files hold a few KB
LAYER = re.compile(r"model\.layers\.(\d+)\.")
# integer sizes (key: least value); null is left to the family's default
SIZES = {"hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
         "head_dim": 1, "intermediate_size": 1, "moe_intermediate_size": 1, "vocab_size": 1,
         "max_position_embeddings": 1, "num_local_experts": 1, "num_experts": 1, "n_routed_experts": 1,
         "num_experts_per_tok": 1, "shared_expert_intermediate_size": 0, "n_shared_experts": 0,
         "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "decoder_sparse_step": 1,
         "q_lora_rank": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1,
         "sliding_window": 0, "num_nextn_predict_layers": 0, "max_window_layers": 0, "moe_num_experts": 1,
         "moe_k": 1, "moe_num_shared_experts": 0, "moe_layer_start_index": 0, "moe_layer_interval": 1,
         "rotary_dim": 1}
# numbers that must be finite and positive (rope_parameters' too)
POSITIVE = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "partial_rotary_factor", "swiglu_alpha",
            "swiglu_limit", "factor")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def transformers_refusals() -> tuple[type[BaseException], ...]:
    """What a transformers config class raises for a value of the wrong kind (its strict dataclass
    validation, huggingface_hub's, or its own checks)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError
    return (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError, OverflowError)


def refused_by_transformers(where: str, err: BaseException) -> ConfigError:
    return ConfigError(where, None, "expected values transformers' config class accepts", shown=" ".join(
        f"refused by transformers ({type(err).__name__}: {err})".split()))


def read_config_json(path: str) -> dict:
    """``path`` (a config.json) as a dict, or a ``ConfigError`` naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(path, None, "expected a readable config.json", shown=f"unreadable ({err.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(path, None, f"a config.json holds at most {MAX_CONFIG_BYTES >> 20} MiB (the hub's hold a "
                          "few KB)", shown=f"more than {MAX_CONFIG_BYTES >> 20} MiB")
    text = utf8(data, path, "a config.json is UTF-8 text, as save_pretrained writes it")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(path, None, "expected a JSON object, as save_pretrained writes it (a truncated or damaged "
                          "file?)", shown=f"invalid JSON at line {err.lineno} column {err.colno} ({err.msg})") from None
    except RecursionError:
        raise ConfigError(path, None, "a config.json nests a few levels",
                          shown="JSON nested too deep to read") from None
    except ValueError as err:   # an integer past Python's 4300 digits
        raise ConfigError(path, None, "expected a JSON object of sizes a model can have",
                          shown=f"unreadable JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(path, type(raw).__name__, "expected a JSON object at the top level, as save_pretrained "
                          "writes it", shown=f"a JSON {_kind(raw)}")
    return raw


def _kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def check_values(raw: dict, path: str) -> None:
    """Each size and epsilon of ``raw`` (a config.json's dict) on its own: an integer in range, a finite
    positive number."""
    for key, least in SIZES.items():
        value = raw.get(key)
        if value is not None and (type(value) is not int or value < least):
            hint = (f" (write the number without quotes: {value})" if isinstance(value, str) and value.strip().isdigit()
                    else "")
            raise ConfigError(f"{path}: {key}", value, f"expected an integer >= {least}{hint}")
    for where, block in (("", raw), ("rope_parameters.", raw.get("rope_parameters")),
                         ("rope_scaling.", raw.get("rope_scaling"))):
        for key in POSITIVE if isinstance(block, dict) else ():
            value = block.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"{path}: {where}{key}", value, "expected a finite number > 0")


def check_relations(raw: dict, path: str, mla: bool) -> None:
    """The sizes of ``raw`` against each other: heads divide the hidden size where ``head_dim`` is
    derived from it, query groups divide heads (grouped-query attention only), top-k within the experts."""
    hidden, heads, groups = raw.get("hidden_size"), raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if not mla and hidden and heads and raw.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{path}: num_attention_heads", heads, f"must divide hidden_size ({hidden}): without "
                          "head_dim each head is hidden_size / num_attention_heads wide")
    if not mla and heads and groups and heads % groups:
        raise ConfigError(f"{path}: num_key_value_heads", groups, f"must divide num_attention_heads ({heads}): each "
                          "query group is a whole number of heads")
    experts = next((raw[k] for k in EXPERT_KEYS if raw.get(k)), None)
    top_k = raw.get("num_experts_per_tok", raw.get("moe_k"))
    if experts and top_k and top_k > experts:
        raise ConfigError(f"{path}: num_experts_per_tok", top_k, f"expected at most the {experts} experts")


def layers_present(names: list[str]) -> int:
    """The decoder layers that tensors ``model.layers.N.`` name (the highest N + 1)."""
    found = [int(m.group(1)) for name in names if (m := LAYER.match(name))]
    return max(found) + 1 if found else 0


def check_against_headers(raw: dict, weights: Any, path: str, beyond_allowed: bool) -> None:
    """``num_hidden_layers`` against the layers present (more present allowed where ``beyond_allowed``:
    multi-token-prediction layers after the decoder's), ``hidden_size`` and ``vocab_size`` against the
    embedding (``weights``: an ``HFWeights``), as the file gives them."""
    layers, present = raw.get("num_hidden_layers"), layers_present(weights.names())
    if layers is not None and layers != present and not (beyond_allowed and layers < present):
        held = f"model.layers.0 to model.layers.{present - 1}" if present else "no model.layers.N"
        raise ConfigError(f"{path}: num_hidden_layers", layers, f"the weights hold {present} decoder layers ({held}); "
                          f"expected {present}")
    _check_embedding(raw.get("hidden_size"), raw.get("vocab_size"), weights, path)


def _check_embedding(hidden: Any, vocab: Any, weights: Any, path: str) -> None:
    embedding = "model.embed_tokens.weight"
    if embedding not in weights:
        return   # the mapping names it missing
    rows, *columns = weights.spec(embedding)[1]
    where = f"{embedding} {[rows, *columns]} in {weights.file_of(embedding)}"
    if hidden is not None and columns != [hidden]:
        raise ConfigError(f"{path}: hidden_size", hidden, f"the weights are {columns[-1] if columns else 0} wide "
                          f"({where})")
    if vocab is not None and rows != vocab:
        raise ConfigError(f"{path}: vocab_size", vocab, f"the embedding has {rows} rows ({where})")


def check_headers(arch: Any, weights: Any, path: str) -> None:
    """The embedding [vocab_size, hidden_size] and the first MoE layer's router [experts, hidden_size]
    of the model transformers read (defaults filled in) against their headers; a missing tensor is
    left to the mapping."""
    _check_embedding(arch.hidden_size, arch.vocab_size, weights, path)
    if not arch.is_moe:
        return
    pattern = re.compile(rf"model\.layers\.{arch.moe_layers[0]}\.[a-z_]+\.(gate|router)\.weight")   # every family's
    for router in [name for name in weights.names() if pattern.fullmatch(name)][:1]:
        shape = weights.spec(router)[1]
        if shape[:1] != [arch.num_experts]:
            raise ConfigError(f"{path}: {experts_key(arch)}", arch.num_experts, f"the router has "
                              f"{shape[0] if shape else 0} rows ({router} {shape} in {weights.file_of(router)})")


def check_shapes(arch: Any, mapping: Any, weights: Any, path: str) -> None:
    """Every HF tensor of ``mapping`` (an ``HFMapping``) against the shape the config gives it; a
    ``ConfigError`` naming the tensor, its file and the config sizes that make its shape."""
    table, cuts = plugin_shapes(arch), {}
    for rule in mapping.rules:
        kind = rule.plugin.split(".", 3)[-1] if rule.plugin.startswith("decoder.layers.") else rule.plugin
        expected, keys = table[kind]
        if kind not in cuts:   # the same for every layer and expert
            cuts[kind] = [list(part.shape) for part in rule.cut(torch.empty(expected, device="meta"))]
        for name, want in zip(rule.hf, cuts[kind]):
            want = want if rule.hf_row is None else [arch.num_experts, *want]
            got = list(weights.spec(name)[1]) if name in weights else want
            if got != want:
                sizes = ", ".join(f"{k} {v}" for k, v in keys)
                raise ConfigError(f"{weights.file_of(name)}: {name}", None, f"{path} makes it {want} ({sizes})",
                                  shown=f"shape {got}")


def experts_key(arch: Any) -> str:
    """The config key that holds the number of routed experts."""
    return next((k for k in EXPERT_KEYS if (arch.config or {}).get(k)), "num_experts")


def plugin_shapes(arch: Any) -> dict[str, tuple[list[int], list[tuple[str, Any]]]]:
    """{plugin tensor (its name after ``decoder.layers.N.``): (its shape on one rank, one expert's row
    for expert weights; the config sizes it is made of, by their HF keys)}."""
    a, m = arch, arch.mla or {}
    H, V, heads, groups, D = a.hidden_size, a.vocab_size, a.num_attention_heads, a.num_query_groups, a.kv_channels
    h, v, n, g, d = (("hidden_size", H), ("vocab_size", V), ("num_attention_heads", heads),
                     ("num_key_value_heads", groups), ("head_dim", D))
    E = (experts_key(a), a.num_experts)
    F = (a.family.expert_ffn_key, a.expert_ffn_hidden_size)
    S = (a.family.moe_keys().get("shared_expert_ffn_hidden_size", "shared_expert_intermediate_size"),
         a.shared_ffn_hidden_size)
    dense = ("intermediate_size", a.ffn_hidden_size)
    nope = ("qk_nope_head_dim", m.get("qk_head_dim") or 0)
    rope = ("qk_rope_head_dim", m.get("qk_pos_emb_head_dim") or 0)
    value, q_rank, kv_rank = (("v_head_dim", m.get("v_head_dim") or 0), ("q_lora_rank", m.get("q_lora_rank") or 0),
                              ("kv_lora_rank", m.get("kv_lora_rank") or 0))
    query = heads * (nope[1] + rope[1])
    table = {
        "embedding.word_embeddings.weight": ([V, H], [v, h]),
        "output_layer.weight": ([V, H], [v, h]),
        "decoder.final_layernorm.weight": ([H], [h]),
        "input_layernorm.weight": ([H], [h]),
        "pre_mlp_layernorm.weight": ([H], [h]),
        "self_attention.linear_qkv.weight": ([(heads + 2 * groups) * D, H], [n, g, d, h]),
        "self_attention.linear_qkv.bias": ([(heads + 2 * groups) * D], [n, g, d]),
        "self_attention.linear_proj.weight": (([H, heads * value[1]], [h, n, value]) if a.mla else
                                              ([H, heads * D], [h, n, d])),
        "self_attention.linear_proj.bias": ([H], [h]),
        "self_attention.core_attention.softmax_offset": ([heads], [n]),
        "self_attention.linear_q_proj.weight": ([query, H], [n, nope, rope, h]),
        "self_attention.linear_q_down_proj.weight": ([q_rank[1], H], [q_rank, h]),
        "self_attention.q_layernorm.weight": (([q_rank[1]], [q_rank]) if a.mla else
                                              ([heads * D], [n, d]) if a.qk_layernorm_scope == "projection" else
                                              ([D], [d])),
        "self_attention.k_layernorm.weight": (([groups * D], [g, d]) if a.qk_layernorm_scope == "projection" else
                                              ([D], [d])),
        "self_attention.linear_q_up_proj.weight": ([query, q_rank[1]], [n, nope, rope, q_rank]),
        "self_attention.linear_kv_down_proj.weight": ([kv_rank[1] + rope[1], H], [kv_rank, rope, h]),
        "self_attention.kv_layernorm.weight": ([kv_rank[1]], [kv_rank]),
        "self_attention.linear_kv_up_proj.weight": ([heads * (nope[1] + value[1]), kv_rank[1]],
                                                    [n, nope, value, kv_rank]),
        "mlp.linear_fc1.weight": ([2 * dense[1], H], [dense, h]),
        "mlp.linear_fc2.weight": ([H, dense[1]], [h, dense]),
        "mlp.router.weight": ([E[1], H], [E, h]),
        "mlp.router.expert_bias": ([E[1]], [E]),
        "mlp.router.bias": ([E[1]], [E]),
        "mlp.experts.weight1": ([H, 2 * F[1]], [h, F]),
        "mlp.experts.weight2": ([F[1], H], [F, h]),
        "mlp.experts.bias1": ([2 * F[1]], [F]),
        "mlp.experts.bias2": ([H], [h]),
        "mlp.shared_expert.weight1": ([H, 2 * S[1]], [h, S]),
        "mlp.shared_expert.weight2": ([S[1], H], [S, h]),
        "mlp.shared_expert.gate_weight": ([H], [h]),
    }
    return table
