"""``moe-plugin export-hf CKPT --out HF_DIR [--arch ARCH]`` (ARCH: a ``model_type`` of ``hf_arch.ARCHITECTURES``).

    export_hf("ckpt", "hf-out")          # then transformers.AutoModelForCausalLM.from_pretrained("hf-out")

Any checkpoint (any layout; ``checkpoint.export.CheckpointSource`` reads it as the 1-rank model,
tensor by tensor) becomes a Hugging Face model directory: ``config.json`` (written by the transformers config class of
the architecture), the weights in the hub's tensor layout (what ``save_pretrained`` writes, so older
transformers and vLLM read it too; ``hf_families``) in shards of at most ``max_shard_size`` with
their index, and the tokenizer files when the checkpoint came from ``import-hf``. The architecture
is ``arch``, else the imported model's type (unless upcycled from a dense one), else inferred (a
shared expert: qwen2_moe; QK-norm: qwen3_moe; otherwise mixtral; no MoE layer: llama, or qwen3 with
QK-norm). The dtype is the
imported model's (``dtype`` overrides; default float32 for a model trained from scratch). A checkpoint
trained from an import carries the import's record and tokenizer files (``checkpoint.api.hf_origin``)
and exports as the import does (``max_position_embeddings``: the larger of the import's and the
training run's sequence length).

A model the architecture cannot express is refused before anything is written, naming what:
learned position embeddings, LayerNorm, a non-SwiGLU MLP, linear biases, QK-norm where the
architecture has none (or none where it has it), QKV biases outside Qwen2-MoE, dense layers in
Mixtral, a shared expert outside Qwen2-MoE (or one without its sigmoid gate), a router that is
not a plain top-k of a softmax (``moe.router``, ``score_function``, ``gate_scale``, ``group_topk``;
Mixtral's gates renormalised), a non-zero aux-loss-free expert bias (``router.expert_bias``).
GPT-OSS is written in its hub layout: each layer's experts as fused tensors (``gate_up_proj`` [E, H, 2F] with
gate and up interleaved, ``down_proj``, their biases), filled expert by expert and written whole, in the
checkpoint's dtype (bf16 for an import of the hub's MXFP4 model: the export does not quantize).
Qwen2-MoE without QKV biases is written with zero biases (the same function; ``qkv_bias`` is true
in every Qwen2-MoE reader). The directory is written under a temporary name and renamed at the end.
Every HF tensor is planned from the headers first (``hf_plan``: names, dtypes, shapes), then each is
made from its plugin tensor (one expert's row at a time) and written into its shard as it comes,
so the peak holds a few tensors whatever the model's size.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from typing import Any, Callable, Optional

import torch

from moe_plugin.checkpoint.confine import copy_new, inside, refuse_link
from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.trust import trust_argument
from moe_plugin.configs import ConfigError
from moe_plugin.interop.hf_arch import (
    ARCHITECTURES,
    DEEPSEEK_ROUTED,
    LATENT_NORM_EPS,
    MLA_KEYS,
    MLA_TYPES,
    MOE_TYPES,
    WINDOW_BY_LAYER_TYPES,
    WINDOW_EVERY_LAYER,
    HFArchitecture,
    transformers_module,
)
from moe_plugin.interop.hf_families import FAMILIES, HFMapping, Rule
from moe_plugin.interop.hf_files import HFShardWriter, parse_size
from moe_plugin.interop.hf_sizes import plugin_shapes, refused_by_transformers, transformers_refusals

logger = logging.getLogger(__name__)

CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "olmoe": "OlmoeConfig", "glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config",
                  "deepseek_v2": "DeepseekV2Config", "gpt_oss": "GptOssConfig", "llama": "LlamaConfig",
                  "mistral": "MistralConfig", "qwen3": "Qwen3Config"}
DEFAULT_SHARD = "5GB"


@trust_argument
def export_hf(ckpt_dir: os.PathLike | str, out_dir: os.PathLike | str, *, arch: Optional[str] = None,
              tag: Optional[str] = None, max_shard_size: str | int = DEFAULT_SHARD, dtype: Optional[str] = None,
              progress: Optional[Callable[[str], None]] = None) -> dict:
    """Write the checkpoint as a Hugging Face model directory (module docstring); returns
    {"path", "model_type", "files", "seconds"}."""
    from moe_plugin.checkpoint.export import CheckpointSource

    say = progress or logger.info
    began = time.perf_counter()
    out_dir = os.fspath(out_dir)
    if os.path.islink(out_dir):   # the user's own link: the export goes where it leads, replacing nothing
        out_dir = os.path.realpath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not empty; export into a new directory (nothing was written)")
    shard_bytes = parse_size(max_shard_size)
    transformers = transformers_module()
    source = CheckpointSource(ckpt_dir, tag, say)
    meta, path = source.meta, source.path
    model_type = _model_type(arch, meta, source.keys())
    hf_arch = architecture_from_checkpoint(meta, source, model_type)
    torch_dtype = getattr(torch, dtype or meta.get("hf", {}).get("dtype") or "float32", None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError("--dtype", dtype, "expected a torch dtype name: float32, bfloat16, float16")
    specs, tasks = hf_plan(hf_arch, source, meta, torch_dtype)
    config = hf_config(transformers, hf_arch, meta, str(torch_dtype).replace("torch.", ""))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(out_dir))}")
    refuse_link(tmp, "the export being written")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)   # new: nothing is written through a link planted there
    shards = None
    try:
        config.save_pretrained(tmp)
        shards = HFShardWriter(tmp, specs, shard_bytes, say)
        fused: dict[str, tuple[torch.Tensor, set]] = {}   # a fused [E, ...] HF tensor filled row by row
        for n, (rule, make) in enumerate(tasks, 1):
            for name, tensor in zip(rule.hf, rule.cut(make())):
                if rule.hf_row is None:
                    shards.write(name, tensor.to(torch_dtype).contiguous())
                    continue
                whole, rows = fused.setdefault(name, (torch.empty(specs[name][1], dtype=torch_dtype), set()))
                whole[rule.hf_row] = tensor
                rows.add(rule.hf_row)
                if len(rows) == whole.shape[0]:
                    shards.write(name, fused.pop(name)[0])
            if n % 64 == 0:
                say(f"tensors of {n}/{len(tasks)} plugin entries written")
        files = ["config.json"] + shards.close()
        for name in meta.get("hf", {}).get("tokenizer_files", []):
            source_file = inside(path, name, os.path.join(path, "moe_plugin.json") + ": hf.tokenizer_files")
            if os.path.isfile(source_file):
                copy_new(source_file, os.path.join(tmp, os.path.basename(name)))
                files.append(os.path.basename(name))
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)   # empty (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        if shards is not None:
            shards.abandon()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - began
    say(f"wrote {out_dir} ({ARCHITECTURES[model_type]}, {len(specs)} tensors, {torch_dtype}) in {seconds:.2f} s")
    return {"path": out_dir, "model_type": model_type, "files": files, "seconds": seconds}


def _model_type(arch: Optional[str], meta: dict, state: list[str]) -> str:
    if arch is not None:
        if arch not in ARCHITECTURES:
            raise ConfigError("--arch", arch, f"expected one of {', '.join(ARCHITECTURES)}")
        return arch
    imported = meta.get("hf", {}).get("model_type")
    moe = any(k.endswith("mlp.router.weight") for k in state)
    if imported and (imported in MOE_TYPES) == moe:   # an upcycled dense import is inferred like any MoE model
        return imported
    qk = any(k.endswith("q_layernorm.weight") for k in state)
    if not moe:
        return "qwen3" if qk else "llama"
    if meta.get("moe", {}).get("activation") == "clamped_swiglu":
        return "gpt_oss"
    if meta.get("model", {}).get("transformer_config", {}).get("multi_latent_attention"):
        return "deepseek_v3" if meta.get("moe", {}).get("score_function") == "sigmoid" else "deepseek_v2"
    if meta.get("moe", {}).get("score_function") == "sigmoid":
        return "glm4_moe"
    if any(".mlp.shared_expert." in k for k in state):
        return "qwen2_moe"
    if qk and meta.get("model", {}).get("qk_layernorm_scope") == "projection":
        return "olmoe"
    return "qwen3_moe" if qk else "mixtral"


def architecture_from_checkpoint(meta: dict, source: Any, model_type: str) -> HFArchitecture:
    """The checkpoint's model (``source``: a ``CheckpointSource``) as ``model_type``, or a
    ``ConfigError`` naming what it cannot express."""
    state = {k: shape for k, (_dtype, shape) in source.specs().items()}   # key -> shape
    model = meta["model"]
    tc = model["transformer_config"]
    moe = meta["moe"]
    name = ARCHITECTURES[model_type]

    def refuse(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(key, value, f"{name} cannot express it: {why}; choose another --arch or train the "
                           "model with what it has")

    check_recorded_sizes(meta, state, os.path.join(getattr(source, "path", "the checkpoint"), "moe_plugin.json"))
    num_layers = int(tc["num_layers"])
    moe_layers = tuple(i for i in range(num_layers) if f"decoder.layers.{i}.mlp.router.weight" in state)
    position = model.get("position_embedding_type") or (
        "learned_absolute" if "embedding.position_embeddings.weight" in state else None)
    if position != "rope":
        raise refuse("position_embedding_type", position, "rotary position embeddings only (--position-embedding-"
                     "type rope)")
    if model.get("rotary_base") is None:
        raise ConfigError("rotary_base", None, "the checkpoint does not record its RoPE base (saved by an older "
                          "moe_plugin); load it into the example with its flags and save it again to export it",
                          shown="not recorded")
    if tc.get("normalization", "LayerNorm") != "RMSNorm":
        raise refuse("normalization", tc.get("normalization", "LayerNorm"), "RMSNorm only (--normalization RMSNorm)")
    if not tc.get("gated_linear_unit") or tc.get("activation_func") != "torch.nn.functional:silu":
        raise refuse("activation_func", tc.get("activation_func"), "SwiGLU MLPs only (--swiglu)")
    gpt_oss = model_type == "gpt_oss"
    if tc.get("add_bias_linear", True) != gpt_oss:
        raise refuse("add_bias_linear", tc.get("add_bias_linear", True), "biases on every attention projection "
                     "(no --disable-bias-linear)" if gpt_oss else "no linear biases (--disable-bias-linear)")
    softmax = tc.get("softmax_type", "vanilla")
    if softmax != ("learnable" if gpt_oss else "vanilla"):
        raise refuse("softmax_type", softmax, "attention sinks (--softmax-type learnable)" if gpt_oss else
                     "no attention sinks (--softmax-type vanilla; GPT-OSS has them)")
    deepseek = model_type in DEEPSEEK_ROUTED
    mla = bool(tc.get("multi_latent_attention"))
    if mla != (model_type in MLA_TYPES):
        raise refuse("multi_latent_attention", mla, "multi-latent attention (--multi-latent-attention)" if not mla
                     else "grouped-query attention, not multi-latent attention (--arch deepseek_v3 or deepseek_v2)")
    qk = bool(tc.get("qk_layernorm"))
    wants_qk = model_type in ("qwen3", "qwen3_moe", "olmoe", *MLA_TYPES)
    if qk != wants_qk and model_type != "glm4_moe":   # GLM-4.5: either (use_qk_norm)
        raise refuse("qk_layernorm", qk, "the compressed query and key/value normalised (--qk-layernorm)" if mla
                     else "QK-norm on every layer" if wants_qk else "no QK-norm")
    if mla and float(tc.get("layernorm_epsilon", 1e-5)) != LATENT_NORM_EPS:
        raise refuse("layernorm_epsilon", tc.get("layernorm_epsilon"), f"norms of epsilon {LATENT_NORM_EPS} "
                     "(transformers' latent norms have it fixed: --norm-epsilon 1e-6)")
    window, window_layers = _window(tc, num_layers, model_type, refuse)
    rotary_percent = float(model.get("rotary_percent", 1.0))
    if rotary_percent != 1.0 and model_type != "glm4_moe":
        raise refuse("rotary_percent", rotary_percent, "RoPE over the whole head (--rotary-percent 1)")
    scope = model.get("qk_layernorm_scope", "head") if qk else "head"
    wants_scope = "projection" if model_type == "olmoe" else "head"
    if qk and scope != wants_scope:
        what = "each whole projection" if wants_scope == "projection" else "each head"
        raise refuse("qk_layernorm_scope", scope, f"QK-norm over {what} (--qk-layernorm-scope {wants_scope})")
    qkv_bias = bool(tc.get("add_qkv_bias")) or gpt_oss
    if qkv_bias and model_type not in ("qwen2_moe", "glm4_moe", "gpt_oss"):
        raise refuse("add_qkv_bias", True, "no QKV biases (Qwen2-MoE, GLM-4.5 and GPT-OSS have them)")
    if model_type in MOE_TYPES:
        if not moe_layers:
            raise refuse("moe.layers", moe.get("layers"), "MoE layers (the checkpoint has none: --arch llama)")
        _check_router(moe, model_type, refuse)
        bias = [k for k in state if k.endswith("router.expert_bias") and bool(source.read(k).abs().max() > 0)]
        if bias and FAMILIES[model_type].router_bias is None:
            raise refuse(bias[0], "non-zero", "routers without an expert bias (the aux-loss-free bias chose the "
                         "experts in training)")
        if model_type in ("mixtral", "olmoe", "gpt_oss") and len(moe_layers) != num_layers:
            dense = [i for i in range(num_layers) if i not in moe_layers]
            raise refuse("moe.layers", moe.get("layers") or f"layer_interval {moe.get('layer_interval')}",
                         f"an MoE MLP on every layer (dense layers {dense})")
        if deepseek and moe_layers != tuple(range(moe_layers[0], num_layers)):
            raise refuse("moe.layers", list(moe_layers), "dense layers first, then MoE layers to the end "
                         "(first_k_dense_replace)")
        shared = int(moe.get("shared_expert_ffn_hidden_size") or 0)
        if model_type == "qwen2_moe" and (not shared or not moe.get("shared_expert_gate")):
            key = "moe.shared_expert_gate" if shared else "moe.shared_expert_ffn_hidden_size"
            raise refuse(key, moe.get(key.split(".")[1]), "a shared expert scaled by a sigmoid gate")
        if deepseek and (moe.get("shared_expert_gate") or not shared):
            key = "moe.shared_expert_gate" if shared else "moe.shared_expert_ffn_hidden_size"
            raise refuse(key, moe.get(key.split(".")[1]), "ungated shared experts (n_shared_experts)")
        if model_type not in ("qwen2_moe", *DEEPSEEK_ROUTED) and shared:
            raise refuse("moe.shared_expert_ffn_hidden_size", shared, "no shared expert")
        if moe.get("drop_tokens", True):
            logger.warning("moe.drop_tokens is true: the plugin's runs dropped routes over capacity; %s drops none",
                           name)
    elif moe_layers:
        raise refuse("moe.layers", moe.get("layers") or moe.get("layer_interval"), "a dense model (the checkpoint "
                     "has MoE layers: --arch mixtral, qwen3_moe, qwen2_moe or olmoe)")
    heads = int(tc["num_attention_heads"])
    E = int(moe["num_experts"]) if moe_layers else 0
    first_moe = moe_layers[0] if moe_layers else None
    expert_ffn = (int(state[f"decoder.layers.{first_moe}.mlp.experts.weight2"][1]) if moe_layers else 0)
    shared_ffn = (int(state[f"decoder.layers.{first_moe}.mlp.shared_expert.weight2"][0])
                  if moe_layers and model_type in ("qwen2_moe", *DEEPSEEK_ROUTED) else 0)
    if deepseek and shared_ffn % expert_ffn:
        raise refuse("moe.shared_expert_ffn_hidden_size", shared_ffn, f"shared experts of the experts' size "
                     f"({expert_ffn}): n_shared_experts x moe_intermediate_size")
    imported = meta.get("hf", {}).get("config") or {}
    latent = dict(mla=({k: tc.get(k) for k in MLA_KEYS}), num_query_groups=heads,
                  kv_channels=int(tc["hidden_size"]) // heads,
                  rope_interleave=bool(imported.get("rope_interleave", True))) if mla else {}
    return HFArchitecture(**{**dict(
        model_type=model_type, num_layers=num_layers, hidden_size=int(tc["hidden_size"]), num_attention_heads=heads,
        num_query_groups=int(tc.get("num_query_groups") or heads),
        kv_channels=int(tc.get("kv_channels") or int(tc["hidden_size"]) // heads),
        ffn_hidden_size=int(tc.get("ffn_hidden_size") or 4 * int(tc["hidden_size"])),
        vocab_size=int(state["embedding.word_embeddings.weight"][0]),
        # training at a shorter --seq-length does not shorten a RoPE model's context: the imported one's stays
        max_position_embeddings=max(int(model.get("max_sequence_length", 4096)),
                                    int((meta.get("hf", {}).get("config") or {}).get("max_position_embeddings", 0))),
        norm_epsilon=float(tc.get("layernorm_epsilon", 1e-5)), rotary_base=float(model["rotary_base"]),
        tied=bool(model.get("tied", False)), qkv_bias=model_type == "qwen2_moe" or qkv_bias, qk_layernorm=qk,
        qk_layernorm_scope=scope, rotary_percent=rotary_percent, rope_scaling=model.get("rope_scaling"),
        dtype=meta.get("hf", {}).get("dtype", "float32"), moe_layers=moe_layers, num_experts=E,
        top_k=int(moe.get("top_k") or 0), normalize_gates=bool(moe.get("normalize_gates", True)),
        expert_ffn_hidden_size=expert_ffn, shared_ffn_hidden_size=shared_ffn,
        shared_gate=shared_ffn > 0 and not deepseek,
        score_function=moe.get("score_function", "softmax"), gate_scale=float(moe.get("gate_scale", 1.0)),
        router_groups=moe.get("router_groups"), group_topk=moe.get("group_topk"),
        router_bias=model_type in FAMILIES and FAMILIES[model_type].router_bias is not None,
        group_score=moe.get("group_score", "top2_sum"),
        window=window, window_layers=window_layers, config=meta.get("hf", {}).get("config"),
        linear_bias=gpt_oss, attention_sinks=gpt_oss, activation=moe.get("activation", "swiglu"),
        swiglu_alpha=float(moe.get("swiglu_alpha", 1.702)), swiglu_limit=float(moe.get("swiglu_limit", 7.0)),
        expert_linear_bias=bool(moe.get("expert_linear_bias")), router_logit_bias=bool(moe.get("router_logit_bias"))),
        **latent})


def check_recorded_sizes(meta: dict, state: dict[str, list[int]], where: str) -> None:
    """The metadata's sizes (``where``: its file) as import-hf checks a config.json's: each an integer in
    range, the epsilon finite and positive, query groups dividing heads, the layers those of the state,
    the recorded HF config an object."""
    tc = meta["model"]["transformer_config"]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size"):
        value = tc.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"{where}: model.transformer_config.{key}", value, "expected an integer >= 1")
    eps = tc.get("layernorm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError(f"{where}: model.transformer_config.layernorm_epsilon", eps, "expected a finite number > 0")
    heads, groups = tc.get("num_attention_heads"), tc.get("num_query_groups")
    if heads and groups and heads % groups and not tc.get("multi_latent_attention"):
        raise ConfigError(f"{where}: model.transformer_config.num_query_groups", groups, f"must divide "
                          f"num_attention_heads ({heads}): each query group is a whole number of heads")
    present = layers_in_state(state)
    if tc.get("num_layers") is not None and tc["num_layers"] != present:
        raise ConfigError(f"{where}: model.transformer_config.num_layers", tc["num_layers"], f"the checkpoint holds "
                          f"{present} decoder layers (decoder.layers.N); expected {present}")
    hf = meta.get("hf", {})
    for key, value in (("hf", hf), ("hf.config", hf.get("config") if isinstance(hf, dict) else None)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}", value, "expected an object (what import-hf recorded)",
                              shown=f"a JSON {type(value).__name__}")


def layers_in_state(state: dict) -> int:
    found = [int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.") and k.split(".")[2].isdigit()]
    return max(found) + 1 if found else 0


def _window(tc: dict, num_layers: int, model_type: str, refuse: Callable[..., ConfigError]):
    """(window W, windowed layers or None) of the checkpoint's ``window_size`` / ``window_attn_skip_freq``
    (``hf_arch._sliding_window``'s inverse), or a ``ConfigError`` where ``model_type`` cannot say it."""
    size = tc.get("window_size")
    if not size:
        return None, None
    left, right = size
    if right != 0:
        raise refuse("window_size", size, "a window over past keys only (--window-size W-1,0)")
    freq = tc.get("window_attn_skip_freq")
    if freq is None:
        layers = None
    elif isinstance(freq, int):
        layers = tuple(int((i + 1) % freq != 0) for i in range(num_layers))
    else:
        layers = tuple(int(bool(v)) for v in freq)
    if layers is not None and all(layers):
        layers = None
    if model_type in WINDOW_EVERY_LAYER and layers is not None:
        raise refuse("window_attn_skip_freq", freq, f"the window on every layer ({', '.join(WINDOW_BY_LAYER_TYPES)} "
                     "window some layers)")
    if model_type not in WINDOW_EVERY_LAYER + WINDOW_BY_LAYER_TYPES:
        raise refuse("window_size", size, "full attention (sliding windows: "
                     f"{', '.join(WINDOW_EVERY_LAYER + WINDOW_BY_LAYER_TYPES)})")
    return int(left) + 1, layers


def _check_router(moe: dict, model_type: str, refuse: Callable[..., ConfigError]) -> None:
    if moe.get("router") != "topk":
        raise refuse("moe.router", moe.get("router"), "a plain top-k of the scores (router 'topk')")
    gpt_oss = model_type == "gpt_oss"
    if model_type == "deepseek_v2":   # softmax, unnormalised gates; any scale; groups ranked by their best
        checked = (("score_function", "softmax"), ("normalize_gates", False), ("activation", "swiglu"),
                   ("group_score", "max" if moe.get("group_topk") else "top2_sum"))
    elif gpt_oss:   # GPT-OSS's experts and router: their biases always there
        checked = (("score_function", "softmax"), ("gate_scale", 1.0), ("group_topk", None), ("normalize_gates", True),
                   ("activation", "clamped_swiglu"), ("expert_linear_bias", True), ("router_logit_bias", True))
    elif model_type in DEEPSEEK_ROUTED:   # sigmoid scores; any scale and group limit
        checked = (("score_function", "sigmoid"), ("activation", "swiglu"), ("group_score", "top2_sum"))
    else:
        checked = (("score_function", "softmax"), ("gate_scale", 1.0), ("group_topk", None), ("activation", "swiglu"))
    if not gpt_oss:
        checked += (("expert_linear_bias", False), ("router_logit_bias", False))
    for key, plain in checked:
        if moe.get(key, plain) != plain:
            raise refuse(f"moe.{key}", moe.get(key), f"{key} {plain!r}")
    if model_type == "mixtral" and not moe.get("normalize_gates", True):
        raise refuse("moe.normalize_gates", False, "the top-k gates renormalised to sum 1 (Mixtral always does)")


def hf_plan(arch: HFArchitecture, source: Any, meta: dict,
            dtype: torch.dtype) -> tuple[dict[str, tuple[torch.dtype, list[int]]], list[tuple[Rule, Callable]]]:
    """({HF name: (dtype, shape)}, [(rule, a function making its plugin tensor)]) of the checkpoint
    ``source`` (a ``CheckpointSource``) as ``arch``, from shapes alone; a plugin tensor with no HF
    place, or of another shape than the recorded architecture's, is refused by name before anything is read."""
    mapping = HFMapping(arch)
    specs = source.specs()
    expected = plugin_shapes(arch)
    used = set(mapping.plugin_only())
    tc = meta["model"]["transformer_config"]
    out: dict[str, tuple[torch.dtype, list[int]]] = {}
    tasks: list[tuple[Rule, Callable]] = []
    for rule in mapping.rules:
        key = rule.plugin
        if key not in specs and key.endswith("linear_qkv.bias") and not tc.get("add_qkv_bias"):
            # Qwen2-MoE always has QKV biases: zeros are the same function
            w_dtype, w_shape = specs[key[:-len("bias")] + "weight"]
            shape, make = [w_shape[0]], (lambda n=w_shape[0], d=w_dtype: torch.zeros(n, dtype=d))
        elif key not in specs:
            raise CheckpointError(f"the checkpoint has no {key!r}, which {arch.architecture} needs")
        elif rule.expert is not None:
            shape, make = specs[key][1][1:], (lambda k=key, e=rule.expert: source.read_expert(k, e))
        else:
            shape, make = specs[key][1], (lambda k=key: source.read(k))
        kind = key.split(".", 3)[-1] if key.startswith("decoder.layers.") else key
        want, sizes = expected[kind]
        if list(shape) != want:   # before the cut reshapes it
            made = ", ".join(f"{k} {v}" for k, v in sizes)
            raise ConfigError(f"{getattr(source, 'path', 'the checkpoint')}: {key}", None,
                              f"the recorded architecture makes it {want} ({made})", shown=f"shape {list(shape)}")
        used.add(key)
        for name, part in zip(rule.hf, rule.cut(torch.empty(shape, device="meta"))):
            out[name] = (dtype, list(part.shape) if rule.hf_row is None else [arch.num_experts, *part.shape])
        tasks.append((rule, make))
    left = sorted(k for k in specs if k not in used)
    if left:
        raise CheckpointError(f"the checkpoint's {left[0]!r} has no place in {arch.architecture}"
                              + (f" (and {len(left) - 1} more)" if len(left) > 1 else "") + " (nothing was written)")
    return out, tasks


def hf_config(transformers: Any, arch: HFArchitecture, meta: dict, dtype: str) -> Any:
    """The transformers config object of ``arch`` (the imported config's other keys kept)."""
    t = arch.model_type
    base = dict(arch.config or {}) if meta.get("hf", {}).get("model_type") == t else {}
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
                "quantization_config"):   # an FP8 import was dequantized: the export is not quantized
        base.pop(key, None)
    fields = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
                  num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_query_groups,
                  head_dim=arch.kv_channels, intermediate_size=arch.ffn_hidden_size, hidden_act="silu",
                  max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_epsilon,
                  rope_parameters={**(arch.rope_scaling or {"rope_type": "default"}), "rope_theta": arch.rotary_base},
                  tie_word_embeddings=arch.tied, attention_dropout=0.0)
    if t == "mixtral":
        fields.update(num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                      intermediate_size=arch.expert_ffn_hidden_size, sliding_window=None, router_jitter_noise=0.0)
    elif t in DEEPSEEK_ROUTED:
        rope = dict(fields["rope_parameters"])
        if arch.rotary_percent != 1.0:
            rope["partial_rotary_factor"] = arch.rotary_percent
        first = arch.moe_layers[0] if arch.moe_layers else arch.num_layers
        fields.update(n_routed_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                      moe_intermediate_size=arch.expert_ffn_hidden_size,
                      n_shared_experts=arch.shared_ffn_hidden_size // arch.expert_ffn_hidden_size,
                      first_k_dense_replace=first, n_group=arch.router_groups or 1, topk_group=arch.group_topk or 1,
                      routed_scaling_factor=arch.gate_scale, norm_topk_prob=arch.normalize_gates,
                      attention_bias=arch.qkv_bias, rope_parameters=rope)
        if t != "deepseek_v2":   # the multi-token-prediction layers are not exported: none, the config says
            fields.update(num_nextn_predict_layers=0)
        if t == "glm4_moe":
            fields.update(use_qk_norm=arch.qk_layernorm)
        else:   # multi-latent attention
            m = arch.mla
            fields.update(q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
                          qk_nope_head_dim=m["qk_head_dim"], qk_rope_head_dim=m["qk_pos_emb_head_dim"],
                          v_head_dim=m["v_head_dim"], head_dim=m["qk_pos_emb_head_dim"])
            if t == "deepseek_v3":
                fields.update(rope_interleave=arch.rope_interleave)
            else:
                fields.update(topk_method="group_limited_greedy" if arch.group_topk else "greedy", mlp_bias=False)
    elif t == "gpt_oss":
        fields.update(num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                      intermediate_size=arch.expert_ffn_hidden_size, swiglu_alpha=arch.swiglu_alpha,
                      swiglu_limit=arch.swiglu_limit, attention_bias=True, sliding_window=None,
                      layer_types=["full_attention"] * arch.num_layers)
    elif t == "olmoe":
        fields.update(num_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                      intermediate_size=arch.expert_ffn_hidden_size, norm_topk_prob=arch.normalize_gates,
                      clip_qkv=None, attention_bias=False)
    elif t in ("qwen3_moe", "qwen2_moe"):
        dense = [i for i in range(arch.num_layers) if i not in arch.moe_layers]
        fields.update(num_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
                      moe_intermediate_size=arch.expert_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=dense,
                      norm_topk_prob=arch.normalize_gates, use_sliding_window=False)
        if t == "qwen2_moe":
            fields.update(shared_expert_intermediate_size=arch.shared_ffn_hidden_size, qkv_bias=True)
        else:
            fields.update(attention_bias=False)
    elif t in ("llama", "qwen3"):
        fields.update(attention_bias=False, **({"mlp_bias": False} if t == "llama" else {}))
    if t in ("mistral", "qwen3"):
        fields.update(sliding_window=None)
    if arch.window:   # transformers' sliding window (hf_arch._sliding_window)
        fields.update(sliding_window=arch.window)
        if t in ("qwen3", "qwen3_moe", "qwen2_moe"):
            fields.update(use_sliding_window=True)
        if t in WINDOW_BY_LAYER_TYPES:
            fields.update(layer_types=["sliding_attention" if windowed else "full_attention"
                                       for windowed in (arch.window_layers or [1] * arch.num_layers)])
    cls = getattr(transformers, CONFIG_CLASSES[t])
    try:
        config = cls(**{**base, **fields})
    except transformers_refusals() as err:   # a value of the wrong kind recorded
        raise refused_by_transformers("moe_plugin.json: hf.config", err) from None
    config.architectures = [arch.architecture]
    config.dtype = dtype
    return config
