"""``moe-plugin import-hf HF_DIR --config ds.json --out CKPT``: a Hugging Face model as a plugin checkpoint.

    result = import_hf("Mixtral-dir", "ds.json", "ckpt")
    print(" ".join(result.flags))   # the example's flags that build this model

Before anything is written: the config is read (``hf_arch``), the ``"moe"`` block is checked against
it field by field (a key set otherwise is refused naming both keys, one left out is filled in), and
every tensor is mapped from the safetensors headers (``hf_mapping``; one left over, missing or of
another shape refused by name). Then the 1-rank checkpoint is written one plugin tensor (one expert's
row) at a time, in the source dtype, with the tokenizer files, the completed DeepSpeed JSON and the
example's command that trains it. A dense model imports as the example's ``--dense`` model (then
``upcycle``). Details: docs/huggingface.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.files import refuse_existing, write_text
from moe_plugin.checkpoint.one_rank import OneRankPlan
from moe_plugin.checkpoint.trust import trust_argument
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.configs.schema import ROOT_KEY, load_ds_config
from moe_plugin.interop.hf_arch import HFArchitecture, read_hf_config
from moe_plugin.interop.hf_mapping import HFMapping
from moe_plugin.interop.hf_files import HFWeights, check_hf_files, tokenizer_files
from moe_plugin.interop.hf_sizes import check_shapes

logger = logging.getLogger(__name__)

TOKENIZER_DIR = "hf"
CONFIG_NAME = "ds_config.json"   # the completed DeepSpeed JSON, in the checkpoint directory by default
EXAMPLE = "examples/gpt_moe/pretrain_gpt_moe.py"
BYTE_VOCAB = 257   # the example's default data: the byte tokenizer's stdlib corpus
# HF buffers that follow from the config (older checkpoints saved RoPE's frequencies)
DERIVED = ("rotary_emb.inv_freq",)
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ImportResult:
    path: str                 # the tag directory written
    model_type: str
    flags: tuple[str, ...]    # the example's model flags
    moe_block: dict           # the "moe" block the checkpoint records (the given one, completed)
    filled: tuple[str, ...]   # "moe" keys import-hf filled in
    seconds: float
    config_path: str = ""     # the DeepSpeed JSON written to train with (the given one, its "moe" block completed)
    command: tuple[str, ...] = ()   # the example's command that trains the imported model (next_command)


@trust_argument
def import_hf(hf_dir: Union[os.PathLike, str], ds_config: Union[dict, os.PathLike, str],
              out_dir: Union[os.PathLike, str], *, tag: str = "step0", dtype: Optional[str] = None,
              config_out: Union[os.PathLike, str, None] = None,
              progress: Optional[Callable[[str], None]] = None) -> ImportResult:
    """Write ``hf_dir`` as a plugin checkpoint ``out_dir/tag`` (module docstring). One process."""
    say = progress or logger.info
    began = time.perf_counter()
    hf_dir = os.fspath(hf_dir)
    check_hf_files(hf_dir)   # a link out of the directory, a hard link: refused before any file is read
    arch = read_hf_config(hf_dir)
    ds = load_ds_config(ds_config)
    block = ds.get(ROOT_KEY)
    if not isinstance(block, dict):
        raise ConfigError(ROOT_KEY, block, "the DeepSpeed config needs a \"moe\" block (its parallel sizes; for an "
                          "MoE model the expert fields may be left out: import-hf fills them in)")
    block, filled = complete_moe_block(arch, block) if arch.is_moe else (block, [])
    moe = MoEConfig.from_dict(block)
    say(f"{hf_dir}: {arch.architecture}, {arch.num_layers} layers, hidden {arch.hidden_size}"
        + (f", {arch.num_experts} experts top-{arch.top_k} on layers {list(arch.moe_layers)}" if arch.is_moe else
           " (dense)"))
    cast = _dtype(dtype)
    refuse_existing(out_dir, tag, "write into another directory")   # before reading the weights (asked again at the write)
    weights = HFWeights(hf_dir, say)
    plan = import_plan(arch, weights, hf_dir, cast, say)
    record = {"architecture": architecture_record(arch),
              "hf": {"model_type": arch.model_type, "architecture": arch.architecture, "dtype": arch.dtype,
                     "source": os.path.abspath(hf_dir), "config": arch.config,
                     "tokenizer_files": [f"{TOKENIZER_DIR}/{n}" for n in tokenizer_files(hf_dir)]}}
    extra = {f"{TOKENIZER_DIR}/{n}": os.path.join(hf_dir, n) for n in tokenizer_files(hf_dir)}
    from moe_plugin.checkpoint.one_rank import write_one_rank

    try:
        path = write_one_rank(out_dir, tag, plan, moe, model_description(arch), record, extra, say)
    finally:
        weights.close()
    config_path = os.fspath(config_out) if config_out is not None else os.path.join(os.fspath(out_dir), CONFIG_NAME)
    completed = {**ds, ROOT_KEY: block}
    os.makedirs(os.path.dirname(os.path.abspath(config_path)), exist_ok=True)
    write_text(config_path, json.dumps(completed, indent=2) + "\n")   # whole or not at all
    seconds = time.perf_counter() - began
    say(f"wrote {path} and {config_path} in {seconds:.2f} s")
    command = next_command(arch, completed, config_path, os.fspath(out_dir), path)
    return ImportResult(path, arch.model_type, tuple(arch.example_flags()), block, tuple(filled), seconds,
                        config_path, tuple(command))


def next_command(arch: HFArchitecture, ds: dict, config_path: str, out_dir: str, tag_path: str) -> list[str]:
    """The ``deepspeed`` command that trains the imported model with the example: as many ranks as the JSON's
    layout needs (its batch sizes give the data-parallel size; without them the smallest world its
    ``"moe"`` block takes), the written JSON, ``--load``, the model's flags, ``--micro-batch-size`` where the
    JSON has none (its ``train_batch_size`` over the ranks); a vocabulary other than the
    example's byte corpus's takes ``--data-path`` data tokenized with the imported tokenizer (``PREFIX``:
    the data ``moe-plugin preprocess`` writes) and ``--tokenizer``."""
    from moe_plugin.data import pad_vocab_size

    moe = MoEConfig.from_dict(ds[ROOT_KEY])
    world = world_size(ds, moe)
    command = ["deepspeed", "--num_gpus", str(world), EXAMPLE, "--deepspeed_config", config_path,
               "--load", out_dir, *arch.example_flags()]
    if ds.get("train_micro_batch_size_per_gpu") is None:   # the example needs it: the JSON's batch over the ranks
        dp = world // (moe.parallel.tensor * moe.parallel.pipeline)
        micro = int(ds.get("train_batch_size") or dp) // (dp * int(ds.get("gradient_accumulation_steps") or 1))
        command += ["--micro-batch-size", str(max(1, micro))]
    if pad_vocab_size(BYTE_VOCAB, 128, moe.parallel.tensor) != arch.vocab_size:
        command += ["--data-path", "PREFIX", "--tokenizer", os.path.join(tag_path, TOKENIZER_DIR)]
    return command


def world_size(ds: dict, moe: MoEConfig) -> int:
    """The ranks a DeepSpeed JSON describes: data-parallel size (train_batch_size over micro-batch x
    accumulation, where two of the three are given) x tensor x pipeline; else the smallest world the
    ``"moe"`` block's layout takes."""
    p = moe.parallel
    model_parallel = p.tensor * p.pipeline
    batch = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    total, micro, steps = batch
    if total and micro:
        return model_parallel * max(1, total // (micro * (steps or 1)))
    for world in range(model_parallel, model_parallel * 1025, model_parallel):
        try:
            moe.check_world_size(world)
        except ConfigError:
            continue
        return world
    return model_parallel


def complete_moe_block(arch: HFArchitecture, block: dict) -> tuple[dict, list[str]]:
    """``block`` with the fields ``arch`` needs filled in; a field set otherwise is a ``ConfigError``
    naming the "moe" key and the HF key."""
    out, filled = dict(block), []
    fields = arch.moe_fields()
    given = MoEConfig.from_dict({**{k: v for k, (v, _) in fields.items() if k != "layers" and v is not None},
                                 **block}).resolved_dict()
    for key, (value, hf_key) in fields.items():
        if key == "layers":
            layer_keys = MoEConfig.from_dict({"num_experts": 1, "router": "switch", **_layer_keys(block)})
            mine = [i for i in range(arch.num_layers) if layer_keys.is_moe_layer(i)]
            if mine == list(arch.moe_layers):
                continue
            if "layers" in block or "layer_interval" in block:
                shown = block.get("layers", f"layer_interval {block.get('layer_interval')}")
                raise ConfigError(f"{ROOT_KEY}.layers", shown, f"the Hugging Face model ({arch.model_type}) has MoE "
                                  f"layers {list(arch.moe_layers)} ({hf_key}); set moe.layers to them or leave "
                                  "layers and layer_interval out (import-hf fills them in)")
            out["layers"] = value
            filled.append("layers")
        elif key in block:
            if given[key] != value:
                raise ConfigError(f"{ROOT_KEY}.{key}", block[key], f"the Hugging Face model ({arch.model_type}) has "
                                  f"{hf_key} = {_show(value)}: set moe.{key} to {_show(value)} or leave it out "
                                  "(import-hf fills it in)")
        elif value != MoEConfig.model_fields[key].default:
            out[key] = value
            filled.append(key)
    return out, filled


def _layer_keys(block: dict) -> dict:
    return {k: block[k] for k in ("layers", "layer_interval") if k in block}


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError("--dtype", name, "expected float32, bfloat16 or float16 (default: the source's dtype)")
    return value


def import_plan(arch: HFArchitecture, weights: HFWeights, where: str,
                dtype: Optional[torch.dtype] = None, say: Callable[[str], None] = lambda line: None) -> OneRankPlan:
    """The 1-rank plugin model's tensors, each made from its HF tensors when asked (``OneRankPlan``);
    every HF tensor is accounted for from the headers first (a left-over or missing one refused by
    name). Floating point tensors keep their dtype, or become ``dtype``. The multi-token-prediction
    layers of the DeepSeek-style families (``model.layers.N`` past ``num_hidden_layers``, which
    transformers does not load either) are left out, with a line saying so."""
    mapping = HFMapping(arch)
    wanted = mapping.hf_keys()
    left = sorted(k for k in weights.names() if k not in wanted and not k.endswith(DERIVED)
                  and not (arch.tied and k == "lm_head.weight"))
    if arch.family.extra_layers:
        beyond = [k for k in left if (m := LAYER.match(k)) and int(m.group(1)) >= arch.num_layers]
        if beyond:
            layers = sorted({int(LAYER.match(k).group(1)) for k in beyond})
            say(f"left out {len(beyond)} tensors of layers {layers}, the multi-token-prediction layers "
                "(transformers does not load them; the plugin does not train them)")
            left = [k for k in left if k not in beyond]
    if left:
        raise CheckpointError(f"{where}: tensor {left[0]!r} has no place in the plugin's {arch.model_type} model"
                              + (f" (and {len(left) - 1} more)" if len(left) > 1 else "")
                              + "; the plugin cannot represent it (nothing was written)")
    for rule in mapping.rules:
        missing = [k for k in rule.hf if k not in weights]
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing (model_type {arch.model_type}, "
                                  f"needed for {rule.plugin})")
    check_shapes(arch, mapping, weights, os.path.join(where, "config.json"))   # every shape, before a tensor is read
    if arch.tied and "lm_head.weight" in weights and not torch.equal(weights.read("lm_head.weight"),
                                                                     weights.read("model.embed_tokens.weight")):
        raise CheckpointError(f"{where}: tie_word_embeddings is true but lm_head.weight differs from "
                              f"model.embed_tokens.weight (model_type {arch.model_type})")

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def shaped(rule) -> tuple[torch.dtype, list[int]]:
        rows = 0 if rule.hf_row is None else 1   # a fused [E, ...] tensor: the rule joins one row
        made = rule.join([torch.empty(weights.spec(k)[1][rows:], dtype=weights.spec(k)[0], device="meta")
                          for k in rule.hf])
        return cast(made).dtype, list(made.shape)

    constants = {k: v for k, v in mapping.plugin_only().items() if isinstance(v, torch.Tensor)}
    dense = {k: (v.dtype, list(v.shape)) for k, v in constants.items()}
    plain = {k: v for k, v in mapping.plugin_only().items() if not isinstance(v, torch.Tensor)}
    dense_rules, expert_rules, experts = {}, {}, {}
    for rule in mapping.rules:
        if rule.expert is None:
            dense[rule.plugin], dense_rules[rule.plugin] = shaped(rule), rule
        else:
            experts.setdefault(rule.plugin, shaped(rule))
            expert_rules[rule.plugin, rule.expert] = rule

    def make(rule) -> torch.Tensor:
        read = weights.read if rule.hf_row is None else (lambda k: weights.read_row(k, rule.hf_row))
        return cast(rule.join([read(k) for k in rule.hf])).contiguous()

    return OneRankPlan(dense, plain, experts, arch.num_experts if experts else 0,
                       lambda key: constants[key] if key in constants else make(dense_rules[key]),
                       lambda key, e: make(expert_rules[key, e]))


def architecture_record(arch: HFArchitecture) -> dict:
    """What ``checkpoint.architecture`` compares a running model with, and the flags that set it."""
    from moe_plugin.checkpoint.metadata import transformer_config_dict

    config = transformer_config_dict(_transformer_config(arch))
    fields = {k: config[k] for k in arch.transformer_fields() if k in config and k != "bias_activation_fusion"}
    return {"transformer_config": fields, "model": arch.model_fields(), "vocab_size": arch.vocab_size,
            "flags": arch.example_flags()}


def _transformer_config(arch: HFArchitecture):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kind = MLATransformerConfig if arch.mla else TransformerConfig
    return kind(**arch.transformer_fields(), init_method_std=0.02, hidden_dropout=0.0,
                             attention_dropout=0.0, pipeline_dtype=torch.float32, use_cpu_initialization=True,
                             bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                             masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)


def model_description(arch: HFArchitecture) -> dict:
    """The metadata's ``model`` (``metadata.model_description``'s keys) of the imported model."""
    from moe_plugin.checkpoint.metadata import transformer_config_dict

    return {"transformer_config": transformer_config_dict(_transformer_config(arch)), "vocab_size": arch.vocab_size,
            "max_sequence_length": arch.max_position_embeddings, "tied": arch.tied,
            "position_embedding_type": "rope", "rotary_base": arch.rotary_base,
            **({"qk_layernorm_scope": arch.qk_layernorm_scope} if arch.qk_layernorm_scope != "head" else {}),
            **({"rope_scaling": dict(arch.rope_scaling)} if arch.rope_scaling else {}),
            **({"rotary_percent": arch.rotary_percent} if arch.rotary_percent != 1.0 else {})}
