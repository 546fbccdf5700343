"""What ``pretrain_gpt_moe.py`` checks before it writes a file or builds a process group.

    plan = check_run(args, world_size)      # a ConfigError naming the flag or JSON key, or a RunPlan

The flags on their own, the DeepSpeed JSON and its ``"moe"`` block (``MoEConfig``), the layout
against the world size and the model flags (``moe.layers`` within ``--num-layers``), and
DeepSpeed's batch arithmetic (``train_batch_size = micro batch x gradient accumulation x
data-parallel size``, the plugin's ``moe_plugin.configs.batch_sizes``, which
``moe_plugin.initialize`` runs as well), which DeepSpeed would otherwise assert deep inside
``deepspeed.initialize``. ``max_token_id`` serves ``build_data``'s vocabulary check.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moe_plugin.configs import ConfigError, MoEConfig, ParallelSizes, batch_sizes
from moe_plugin.configs.schema import load_ds_config


@dataclass(frozen=True)
class RunPlan:
    """What the checks resolved: the DeepSpeed config (micro batch filled in), the ``"moe"``
    block, the parallel sizes for this world size and the batch arithmetic."""

    ds_config: dict
    moe_config: MoEConfig
    sizes: ParallelSizes
    micro_batch_size: int
    grad_accumulation: int
    global_batch_size: int


def check_run(args: argparse.Namespace, world_size: int) -> RunPlan:
    """Every mistake a flag or the JSON can hold, as a ``ConfigError`` naming it, before any side effect."""
    check_flags(args)
    ds = dict(load_ds_config(args.deepspeed_config))
    moe_config = MoEConfig.from_ds_config(ds)
    sizes = moe_config.check_world_size(world_size)
    check_layout(args, moe_config)
    micro, gas, total = resolve_batch(args, ds, sizes.dp)
    return RunPlan(ds, moe_config, sizes, micro, gas, total)


def check_flags(args: argparse.Namespace) -> None:
    """The flags on their own."""
    positive = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                "train_iters", "eval_iters", "log_interval", "make_vocab_size_divisible_by", "corpus_bytes",
                "max_skipped_steps", "distributed_timeout_minutes")
    for name in positive:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "expected an integer >= 1")
    for name in ("eval_interval", "save_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "expected an integer >= 0")
    keep_last = getattr(args, "keep_last", None)
    if keep_last is not None and keep_last < 1:
        raise ConfigError("--keep-last", keep_last, "expected an integer >= 1 (the number of newest tags to keep)")
    if keep_last is not None and args.save is None:
        raise ConfigError("--keep-last", keep_last, "removes old tags of --save, which is not given")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end <= args.train_iters:
        raise ConfigError("--profile-step-end", args.profile_step_end, f"the profiled steps must lie in "
                          f"0 <= --profile-step-start ({args.profile_step_start}) < --profile-step-end <= "
                          f"--train-iters ({args.train_iters})")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError("--num-attention-heads", args.num_attention_heads, f"must divide --hidden-size "
                          f"({args.hidden_size})")
    check_architecture(args)
    if not 0.0 < args.valid_fraction < 1.0:
        raise ConfigError("--valid-fraction", args.valid_fraction, "expected a fraction of the documents, "
                          "strictly between 0 and 1 (e.g. 0.05)")
    if args.max_position_embeddings < args.seq_length:
        raise ConfigError("--max-position-embeddings", args.max_position_embeddings, f"must be at least "
                          f"--seq-length ({args.seq_length})")
    if getattr(args, "dense", False) and (args.router_skew or args.freeze_router):
        flag = "--router-skew" if args.router_skew else "--freeze-router"
        raise ConfigError(flag, getattr(args, flag[2:].replace("-", "_")), "the dense baseline (--dense) has no "
                          "router; drop one of the two flags")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ConfigError("--exit-duration-in-mins", args.exit_duration_in_mins, "expected minutes > 0")
    if getattr(args, "async_save", False) and args.save is None:
        raise ConfigError("--async-save", True, "writes the checkpoints of --save in the background, which is not "
                          "given: pass --save DIR too")
    for flag, given in (("--exit-signal-handler", args.exit_signal_handler),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins)):
        if given not in (None, False) and args.save is None:   # before anything is written
            raise ConfigError(flag, given, "it saves a checkpoint before it exits: pass --save DIR too")
    if args.deepspeed_config is None:
        raise ConfigError("--deepspeed_config", None, "pass the DeepSpeed JSON with the \"moe\" block, e.g. "
                          "examples/gpt_moe/configs/tiny_cpu_4rank.json", shown="missing")
    if getattr(args, "finetune", False) and args.load is None:
        raise ConfigError("--finetune", True, "trains the weights of the checkpoint of --load, which is not given")
    if getattr(args, "valid_data_path", None) is not None and not (Path(args.valid_data_path + ".bin").exists()
                                                                   and Path(args.valid_data_path + ".idx").exists()):
        raise ConfigError("--valid-data-path", args.valid_data_path, "expected the prefix of PREFIX.bin and "
                          "PREFIX.idx (Megatron's indexed format)")
    if args.data_path is not None and not (Path(args.data_path + ".bin").exists()
                                           and Path(args.data_path + ".idx").exists()):
        raise ConfigError("--data-path", args.data_path, "expected the prefix of PREFIX.bin and PREFIX.idx "
                          "(Megatron's indexed format), e.g. data/my-corpus_text_document")
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None and args.data_path is None:
        raise ConfigError("--tokenizer", tokenizer, "gives the vocabulary of --data-path data, which is not given "
                          "(the stdlib corpus is byte tokens)")
    if tokenizer is not None and args.vocab_size is not None:
        raise ConfigError("--vocab-size", args.vocab_size, "--tokenizer gives the vocabulary already; pass one of "
                          "the two")


def check_architecture(args: argparse.Namespace) -> None:
    """The Llama-style flags: combinations Megatron-LM would take silently or fail on deep inside."""
    groups = getattr(args, "num_query_groups", None)
    if groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups", groups, "needs --group-query-attention (without it every "
                          "attention head has its own key/value head)")
    if groups is not None and groups < 1:
        raise ConfigError("--num-query-groups", groups, "expected an integer >= 1")
    if args.group_query_attention and args.num_attention_heads % (groups or 1):
        raise ConfigError("--num-query-groups", groups, f"must divide --num-attention-heads "
                          f"({args.num_attention_heads}): each key/value head serves as many query heads")
    if args.rotary_base is not None and args.position_embedding_type != "rope":
        raise ConfigError("--rotary-base", args.rotary_base, f"needs --position-embedding-type rope (it is "
                          f"{args.position_embedding_type})")
    if args.rotary_base is not None and not args.rotary_base > 1:
        raise ConfigError("--rotary-base", args.rotary_base, "expected a base period > 1 (e.g. 10000)")
    scaling = getattr(args, "rope_scaling", None)
    if scaling is not None:
        if args.position_embedding_type != "rope":
            raise ConfigError("--rope-scaling", scaling, f"needs --position-embedding-type rope (it is "
                              f"{args.position_embedding_type})")
        from moe_plugin.integration.rope import RopeScaling

        RopeScaling.from_dict(scaling)   # a bad value named before any side effect
    percent = getattr(args, "rotary_percent", None)
    if percent is not None and args.position_embedding_type != "rope":
        raise ConfigError("--rotary-percent", percent, f"needs --position-embedding-type rope (it is "
                          f"{args.position_embedding_type})")
    if percent is not None and not 0 < percent <= 1:
        raise ConfigError("--rotary-percent", percent, "expected a share of the head's dimensions in (0, 1]")
    if args.kv_channels is not None and args.kv_channels < 1:
        raise ConfigError("--kv-channels", args.kv_channels, "expected an integer >= 1 (the size of a head)")
    if not args.norm_epsilon > 0:
        raise ConfigError("--norm-epsilon", args.norm_epsilon, "expected a number > 0 (e.g. 1e-5)")
    scope = getattr(args, "qk_layernorm_scope", "head")
    if scope == "projection" and not (args.qk_layernorm and args.normalization == "RMSNorm"):
        raise ConfigError("--qk-layernorm-scope", scope, "normalises the whole query and key projections with "
                          "RMSNorm: it needs --qk-layernorm and --normalization RMSNorm")
    check_mla(args)
    if getattr(args, "window_size", None) is not None or getattr(args, "window_attn_skip_freq", None) is not None:
        window_fields(args)   # a bad value named before anything happens


def window_fields(args: argparse.Namespace) -> dict:
    """``--window-size`` and ``--window-attn-skip-freq`` as Megatron's ``window_size`` / ``window_attn_skip_freq``."""
    if args.window_size is None:
        raise ConfigError("--window-attn-skip-freq", args.window_attn_skip_freq, "needs --window-size (which layers "
                          "of a sliding window attend fully)")
    text = str(args.window_size).strip().strip("()")
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("--window-size", args.window_size, "expected LEFT,RIGHT: two integers >= 0, e.g. 4095,0 "
                          "(a Hugging Face sliding_window of 4096)") from None
    if left < 0 or right < 0:
        raise ConfigError("--window-size", args.window_size, "expected two integers >= 0")
    freq = args.window_attn_skip_freq
    if freq is not None:
        try:
            freq = json.loads(freq)
        except json.JSONDecodeError:
            freq = None
        layers = args.num_layers
        good = (isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1) or (
            isinstance(freq, list) and len(freq) == layers and all(v in (0, 1) for v in freq))
        if not good:
            raise ConfigError("--window-attn-skip-freq", args.window_attn_skip_freq, f"expected an integer >= 1 (every "
                              f"Nth layer full) or a JSON list of {layers} zeros and ones (1: windowed)")
    return dict(window_size=(left, right), window_attn_skip_freq=freq)


MLA_FLAGS = ("q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def check_mla(args: argparse.Namespace) -> None:
    """Multi-latent attention's flags: sizes >= 1, RoPE, and nothing of grouped-query attention's."""
    if not getattr(args, "multi_latent_attention", False):
        given = [name for name in MLA_FLAGS if getattr(args, name, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(flag, getattr(args, given[0]), "sizes multi-latent attention: it needs "
                              "--multi-latent-attention")
        return
    for name in ("kv_lora_rank", *MLA_FLAGS):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError("--" + name.replace("_", "-"), value, "expected an integer >= 1")
    if args.position_embedding_type != "rope":
        raise ConfigError("--multi-latent-attention", True, f"rotates a shared key: it needs "
                          f"--position-embedding-type rope (it is {args.position_embedding_type})")
    if args.group_query_attention:
        raise ConfigError("--group-query-attention", True, "multi-latent attention has a key and value per head "
                          "(from its compressed key/value); leave --group-query-attention out")
    for flag, value in (("--rotary-percent", args.rotary_percent), ("--add-qkv-bias", args.add_qkv_bias or None),
                        ("--qk-layernorm-scope", None if args.qk_layernorm_scope == "head" else "projection")):
        if value is not None:
            raise ConfigError(flag, value, "does not apply to multi-latent attention (its rotated dimensions are "
                              "--qk-pos-emb-head-dim; its projections have no bias)")


def mla_head_dims(args: argparse.Namespace) -> tuple[int, int]:
    """(the query/key head's unrotated size, its rotated size) of the MLA flags, with their defaults:
    --kv-channels or hidden / heads, and half of that (at least 2)."""
    head = args.qk_head_dim or args.kv_channels or args.hidden_size // args.num_attention_heads
    return head, args.qk_pos_emb_head_dim or max(head // 2, 2)


def check_layout(args: argparse.Namespace, moe_config: MoEConfig) -> None:
    """The ``moe.parallel`` layout against the model flags."""
    p = moe_config.parallel
    if p.pipeline > 1:
        check_pipeline_available(moe_config)
    if args.num_attention_heads % p.tensor:
        raise ConfigError("moe.parallel.tensor", p.tensor, f"must divide --num-attention-heads "
                          f"({args.num_attention_heads})")
    if getattr(args, "multi_latent_attention", False):   # Megatron splits the down projections' outputs over TP
        _head, rotated = mla_head_dims(args)
        sizes = {"--kv-lora-rank + --qk-pos-emb-head-dim": args.kv_lora_rank + rotated}
        if args.q_lora_rank is not None:
            sizes["--q-lora-rank"] = args.q_lora_rank
        for flag, size in sizes.items():
            if size % p.tensor:
                raise ConfigError("moe.parallel.tensor", p.tensor, f"must divide {flag}'s down projection "
                                  f"({size} outputs), which Megatron's MLA splits over the tensor-parallel ranks")
    groups = (args.num_query_groups or 1) if args.group_query_attention else args.num_attention_heads
    if args.group_query_attention and groups % p.tensor:
        raise ConfigError("--num-query-groups", groups, f"must be a multiple of moe.parallel.tensor ({p.tensor}): "
                          "each tensor-parallel rank holds whole key/value heads (--group-query-attention)")
    if getattr(args, "dense", False) and p.pipeline > 1:
        raise ConfigError("moe.parallel.pipeline", p.pipeline, "--dense (the dense baseline) runs without "
                          "pipeline parallelism; use 1")
    if args.num_layers % p.pipeline:
        raise ConfigError("moe.parallel.pipeline", p.pipeline, f"must divide --num-layers ({args.num_layers})")
    moe_config.check_num_layers(args.num_layers, "--num-layers")
    if (getattr(args, "swiglu", False) and not getattr(args, "dense", False)
            and moe_config.activation not in ("swiglu", "clamped_swiglu")
            and all(moe_config.is_moe_layer(i) for i in range(args.num_layers))):
        raise ConfigError("--swiglu", True, "every layer's MLP is an MoE layer, so there is no dense MLP to gate; the "
                          "experts' activation is moe.activation (set it to \"swiglu\" or \"clamped_swiglu\")")
    if args.data_path is None:
        from moe_plugin.data import pad_vocab_size

        try:
            pad_vocab_size(257, args.make_vocab_size_divisible_by, p.tensor)
        except ValueError as err:
            raise ConfigError("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by, str(err)) from None


def resolve_batch(args: argparse.Namespace, ds: dict, dp: int) -> tuple[int, int, int]:
    """(micro batch, gradient accumulation steps, global batch): DeepSpeed's arithmetic, checked
    here so that a mismatch names the key; the JSON gets the micro batch of the flag if it has none."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro is None:
        if args.micro_batch_size is None:
            raise ConfigError("train_micro_batch_size_per_gpu", None, "set it in the JSON or pass "
                              "--micro-batch-size", shown="missing")
        micro = ds["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    elif args.micro_batch_size is not None and args.micro_batch_size != micro:
        raise ConfigError("--micro-batch-size", args.micro_batch_size, f"must equal the DeepSpeed JSON's "
                          f"train_micro_batch_size_per_gpu ({micro}); change one of them")
    sizes = batch_sizes(ds, dp)   # the plugin's check, the one moe_plugin.initialize runs
    if ds.get("train_batch_size") is None:
        ds["train_batch_size"] = sizes.total
    return sizes.micro, sizes.gas, sizes.total


def max_token_id(bin_path: str, dtype, cache_dir: Optional[str]) -> int:
    """The largest token id in ``bin_path`` (-1 when empty): one pass over the memory-mapped file,
    remembered in ``cache_dir/max_token_ids.json`` under the file's path, size and modification time."""
    stat = os.stat(bin_path)
    key, stamp = os.path.abspath(bin_path), [stat.st_size, stat.st_mtime_ns, np.dtype(dtype).name]
    cache = Path(cache_dir) / "max_token_ids.json" if cache_dir else None
    try:
        known = json.loads(cache.read_text()) if cache is not None else {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), dict) and known[key].get("stamp") == stamp:
        return int(known[key]["max"])
    largest = int(np.memmap(bin_path, dtype=dtype, mode="r").max()) if stat.st_size else -1
    if cache is not None:
        known[key] = {"stamp": stamp, "max": largest}
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        try:   # every rank may get here at once: each writes its own file and renames it into place
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(known, indent=1) + "\n")
            os.replace(tmp, cache)
        except OSError:
            tmp.unlink(missing_ok=True)   # a cache only: a read-only directory costs one pass per run
    return largest


def check_pipeline_available(moe_config: MoEConfig) -> None:
    """pp > 1 needs the plugin's PipelineEngine path; say so early where this install lacks it."""
    if importlib.util.find_spec("moe_plugin.integration.pipeline") is None:
        raise ConfigError("moe.parallel.pipeline", moe_config.parallel.pipeline, "pipeline parallelism is not "
                          "available: it needs moe_plugin.integration.pipeline (DeepSpeed's PipelineEngine), which "
                          "this version lacks; use 1")
