"""``moe-plugin export-hf CKPT --out HF_DIR [--arch MODEL_TYPE]``: any checkpoint as a Hugging Face directory.

    export_hf("ckpt", "hf-out")          # then transformers.AutoModelForCausalLM.from_pretrained("hf-out")

Any layout is read as the 1-rank model, tensor by tensor (``checkpoint.export.CheckpointSource``), and
written as ``config.json`` (the family's transformers config class), the weights in the hub's layout
in shards of at most ``max_shard_size`` with their index, and the tokenizer files of an import. The
family is ``arch``, else the imported one, else inferred from the checkpoint's features (each family's
``infers``). What the family cannot express is refused naming the key before anything is written;
every HF tensor is planned from the headers first, and the directory is written under a temporary
name and renamed at the end, so the peak holds a few tensors whatever the model's size.
Details: docs/huggingface.md.
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
from moe_plugin.interop.families import BY_TYPE, MODEL_TYPES, REGISTRY, family, titles
from moe_plugin.interop.families.blocks import Rule
from moe_plugin.interop.hf_arch import LATENT_NORM_EPS, MLA_KEYS, HFArchitecture, transformers_module
from moe_plugin.interop.hf_files import HFShardWriter, parse_size
from moe_plugin.interop.hf_mapping import HFMapping
from moe_plugin.interop.hf_sizes import plugin_shapes, refused_by_transformers, transformers_refusals

logger = logging.getLogger(__name__)

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
    say(f"wrote {out_dir} ({BY_TYPE[model_type].architecture}, {len(specs)} tensors, {torch_dtype}) in {seconds:.2f} s")
    return {"path": out_dir, "model_type": model_type, "files": files, "seconds": seconds}


def _model_type(arch: Optional[str], meta: dict, state: list[str]) -> str:
    """``arch``, else the imported model's type (unless upcycled from a dense one), else the family of the
    best ``infer_rank`` whose ``infers`` accepts the checkpoint's features."""
    if arch is not None:
        if arch not in BY_TYPE:
            raise ConfigError("--arch", arch, f"expected one of {', '.join(MODEL_TYPES)}")
        return arch
    imported = meta.get("hf", {}).get("model_type")
    moe = any(k.endswith("mlp.router.weight") for k in state)
    if imported in BY_TYPE and BY_TYPE[imported].moe == moe:   # an upcycled dense import is inferred like any MoE
        return imported
    features = dict(moe=moe, qk=any(k.endswith("q_layernorm.weight") for k in state),
                    activation=meta.get("moe", {}).get("activation", "swiglu"),
                    mla=bool(meta.get("model", {}).get("transformer_config", {}).get("multi_latent_attention")),
                    score_function=meta.get("moe", {}).get("score_function", "softmax"),
                    shared=any(".mlp.shared_expert." in k for k in state),
                    qk_scope=meta.get("model", {}).get("qk_layernorm_scope", "head"))
    ranked = sorted((f for f in REGISTRY if f.infer_rank is not None), key=lambda f: f.infer_rank)
    return next(f.model_type for f in ranked if f.infers(features))


def architecture_from_checkpoint(meta: dict, source: Any, model_type: str) -> HFArchitecture:
    """The checkpoint's model (``source``: a ``CheckpointSource``) as ``model_type``, or a
    ``ConfigError`` naming what it cannot express."""
    state = {k: shape for k, (_dtype, shape) in source.specs().items()}   # key -> shape
    model = meta["model"]
    tc = model["transformer_config"]
    moe = meta["moe"]
    fam = family(model_type, "--arch")
    name = fam.architecture

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
    if tc.get("add_bias_linear", True) != fam.linear_bias:
        raise refuse("add_bias_linear", tc.get("add_bias_linear", True), "biases on every attention projection "
                     "(no --disable-bias-linear)" if fam.linear_bias else "no linear biases (--disable-bias-linear)")
    softmax = tc.get("softmax_type", "vanilla")
    if softmax != ("learnable" if fam.sinks else "vanilla"):
        raise refuse("softmax_type", softmax, "attention sinks (--softmax-type learnable)" if fam.sinks else
                     "no attention sinks (--softmax-type vanilla; " + titles(f for f in REGISTRY if f.sinks)
                     + " has them)")
    mla = bool(tc.get("multi_latent_attention"))
    if mla != fam.mla:
        raise refuse("multi_latent_attention", mla, "multi-latent attention (--multi-latent-attention)" if not mla
                     else "grouped-query attention, not multi-latent attention (--arch "
                     + " or ".join(f.model_type for f in REGISTRY if f.mla) + ")")
    qk = bool(tc.get("qk_layernorm"))
    wants_qk = bool(fam.qk_norm)
    if qk != wants_qk and fam.qk_norm is not None:   # None: either (a config key says)
        raise refuse("qk_layernorm", qk, "the compressed query and key/value normalised (--qk-layernorm)" if mla
                     else "QK-norm on every layer" if wants_qk else "no QK-norm")
    if mla and float(tc.get("layernorm_epsilon", 1e-5)) != LATENT_NORM_EPS:
        raise refuse("layernorm_epsilon", tc.get("layernorm_epsilon"), f"norms of epsilon {LATENT_NORM_EPS} "
                     "(transformers' latent norms have it fixed: --norm-epsilon 1e-6)")
    window, window_layers = _window(tc, num_layers, fam, refuse)
    rotary_percent = float(model.get("rotary_percent", 1.0))
    if rotary_percent != 1.0 and not fam.partial_rotary:
        raise refuse("rotary_percent", rotary_percent, "RoPE over the whole head (--rotary-percent 1)")
    scope = model.get("qk_layernorm_scope", "head") if qk else "head"
    wants_scope = fam.qk_scope
    if qk and scope != wants_scope:
        what = "each whole projection" if wants_scope == "projection" else "each head"
        raise refuse("qk_layernorm_scope", scope, f"QK-norm over {what} (--qk-layernorm-scope {wants_scope})")
    qkv_bias = bool(tc.get("add_qkv_bias")) or fam.linear_bias
    if qkv_bias and not fam.qkv_bias:
        raise refuse("add_qkv_bias", True, "no QKV biases (" + titles(f for f in REGISTRY if f.qkv_bias)
                     + " have them)")
    if fam.moe:
        if not moe_layers:
            raise refuse("moe.layers", moe.get("layers"), "MoE layers (the checkpoint has none: --arch llama)")
        _check_router(moe, fam, refuse)
        bias = [k for k in state if k.endswith("router.expert_bias") and bool(source.read(k).abs().max() > 0)]
        if bias and not fam.has_correction_bias:
            raise refuse(bias[0], "non-zero", "routers without an expert bias (the aux-loss-free bias chose the "
                         "experts in training)")
        if fam.layers == "every" and len(moe_layers) != num_layers:
            dense = [i for i in range(num_layers) if i not in moe_layers]
            raise refuse("moe.layers", moe.get("layers") or f"layer_interval {moe.get('layer_interval')}",
                         f"an MoE MLP on every layer (dense layers {dense})")
        if fam.layers == "dense_first" and moe_layers != tuple(range(moe_layers[0], num_layers)):
            raise refuse("moe.layers", list(moe_layers), "dense layers first, then MoE layers to the end "
                         "(first_k_dense_replace)")
        shared = int(moe.get("shared_expert_ffn_hidden_size") or 0)
        if fam.shared == "gated" and (not shared or not moe.get("shared_expert_gate")):
            key = "moe.shared_expert_gate" if shared else "moe.shared_expert_ffn_hidden_size"
            raise refuse(key, moe.get(key.split(".")[1]), "a shared expert scaled by a sigmoid gate")
        if fam.shared == "ungated" and (moe.get("shared_expert_gate") or not shared):
            key = "moe.shared_expert_gate" if shared else "moe.shared_expert_ffn_hidden_size"
            raise refuse(key, moe.get(key.split(".")[1]), "ungated shared experts (n_shared_experts)")
        if fam.shared is None and shared:
            raise refuse("moe.shared_expert_ffn_hidden_size", shared, "no shared expert")
        if moe.get("drop_tokens", True):
            logger.warning("moe.drop_tokens is true: the plugin's runs dropped routes over capacity; %s drops none",
                           name)
    elif moe_layers:
        raise refuse("moe.layers", moe.get("layers") or moe.get("layer_interval"), "a dense model (the checkpoint "
                     "has MoE layers: --arch " + " or ".join(f.model_type for f in REGISTRY if f.moe) + ")")
    heads = int(tc["num_attention_heads"])
    E = int(moe["num_experts"]) if moe_layers else 0
    first_moe = moe_layers[0] if moe_layers else None
    expert_ffn = (int(state[f"decoder.layers.{first_moe}.mlp.experts.weight2"][1]) if moe_layers else 0)
    shared_ffn = (int(state[f"decoder.layers.{first_moe}.mlp.shared_expert.weight2"][0])
                  if moe_layers and fam.shared else 0)
    if fam.shared == "ungated" and shared_ffn % expert_ffn:
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
        tied=bool(model.get("tied", False)), qkv_bias=fam.always_qkv_bias or qkv_bias, qk_layernorm=qk,
        qk_layernorm_scope=scope, rotary_percent=rotary_percent, rope_scaling=model.get("rope_scaling"),
        dtype=meta.get("hf", {}).get("dtype", "float32"), moe_layers=moe_layers, num_experts=E,
        top_k=int(moe.get("top_k") or 0), normalize_gates=bool(moe.get("normalize_gates", True)),
        expert_ffn_hidden_size=expert_ffn, shared_ffn_hidden_size=shared_ffn,
        shared_gate=shared_ffn > 0 and fam.shared == "gated",
        score_function=moe.get("score_function", "softmax"), gate_scale=float(moe.get("gate_scale", 1.0)),
        router_groups=moe.get("router_groups"), group_topk=moe.get("group_topk"),
        router_bias=fam.has_correction_bias,
        group_score=moe.get("group_score", "top2_sum"), expert_bias_on=moe.get("expert_bias_on"),
        window=window, window_layers=window_layers, config=meta.get("hf", {}).get("config"),
        linear_bias=fam.linear_bias, attention_sinks=fam.sinks, activation=moe.get("activation", "swiglu"),
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


def _window(tc: dict, num_layers: int, fam: Any, refuse: Callable[..., ConfigError]):
    """(window W, windowed layers or None) of the checkpoint's ``window_size`` / ``window_attn_skip_freq``
    (``hf_arch._sliding_window``'s inverse), or a ``ConfigError`` where the family ``fam`` cannot say it."""
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
    by_layer = [f.model_type for f in REGISTRY if f.window == "layer_types"]
    if fam.window == "every_layer" and layers is not None:
        raise refuse("window_attn_skip_freq", freq, f"the window on every layer ({', '.join(by_layer)} "
                     "window some layers)")
    if not fam.windowed:
        raise refuse("window_size", size, "full attention (sliding windows: "
                     f"{', '.join(f.model_type for f in REGISTRY if f.windowed)})")
    return int(left) + 1, layers


def _check_router(moe: dict, fam: Any, refuse: Callable[..., ConfigError]) -> None:
    if moe.get("router") != "topk":
        raise refuse("moe.router", moe.get("router"), "a plain top-k of the scores (router 'topk')")
    for key, plain in fam.router_checks(moe):
        if moe.get(key, plain) != plain:
            raise refuse(f"moe.{key}", moe.get(key), f"{key} {plain!r}")
    fam.check_router(moe, refuse)


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
    fam = arch.family
    fields.update(fam.config_fields(arch, fields))
    if arch.window:   # transformers' sliding window (hf_arch._sliding_window)
        fields.update(sliding_window=arch.window)
        if fam.use_sliding_window_key:
            fields.update(use_sliding_window=True)
        if fam.window == "layer_types":
            fields.update(layer_types=["sliding_attention" if windowed else "full_attention"
                                       for windowed in (arch.window_layers or [1] * arch.num_layers)])
    cls = getattr(transformers, fam.config_class)
    try:
        config = cls(**{**base, **fields})
    except transformers_refusals() as err:   # a value of the wrong kind recorded
        raise refused_by_transformers("moe_plugin.json: hf.config", err) from None
    config.architectures = [arch.architecture]
    config.dtype = dtype
    return config
