"""``moe-plugin bench packing``: packed conversations against one conversation per padded sequence.

Conversations of a skewed length distribution (geometric, mean ``--mean-length``, clipped to the
sequence) go through the same GPT-MoE (Megatron-Core's ``GPTModel`` with the plugin's MoE layers, one
process, fp32) twice: packed whole into ``--seq-length`` tokens (``PackedConversations``, thd format)
and one conversation per sequence, the rest padding (``pack=False``). Each mode trains forward +
backward over every conversation once in micro-batches of ``--micro-batch`` sequences (``packed_loss``,
the global mean over the loss tokens); reported per mode: sequences, packing efficiency (real tokens /
tokens computed), seconds, real tokens per second, and the ratio of the two modes' real tokens per
second measured side by side in this run (the modes alternate over ``--repeats`` rounds; medians).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def conversation_lengths(count: int, mean: int, seq_length: int, seed: int) -> np.ndarray:
    """``count`` lengths, geometric with mean ``mean`` (most short, a few long), within 2 .. ``seq_length``."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.geometric(1.0 / mean, count), 2, seq_length)


def _model(args: argparse.Namespace, vocab: int):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    import moe_plugin
    from moe_plugin import gpt_moe_spec

    ds = {"train_batch_size": args.micro_batch, "train_micro_batch_size_per_gpu": args.micro_batch,
          "gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "moe": {"num_experts": args.experts, "router": "topk", "top_k": 2, "drop_tokens": False,
                  "aux_loss_coeff": 0.01}}

    def provider(moe_config, groups):
        config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                                   ffn_hidden_size=2 * args.hidden, use_cpu_initialization=True, hidden_dropout=0.0,
                                   attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
                                   gradient_accumulation_fusion=False, apply_rope_fusion=False)
        torch.manual_seed(1)
        return GPTModel(config, gpt_moe_spec(moe_config, config, groups), vocab_size=vocab,
                        max_sequence_length=args.seq_length, position_embedding_type="rope")

    return moe_plugin.initialize(ds, provider, seed=1, print_summary=False)


def _epoch(engine, samples, micro: int) -> float:
    """Seconds of forward + backward + step over every sequence of ``samples`` once."""
    from moe_plugin.data.packing import padded_indices
    from moe_plugin.integration.packed import packed_loss

    indices = padded_indices(len(samples), micro)
    began = time.perf_counter()
    for first in range(0, len(indices), micro):
        rows = indices[first:first + micro]
        loss = packed_loss(engine, samples.batch(rows), samples.loss_tokens(rows), 1)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from moe_plugin.data import read_indexed, write_indexed
    from moe_plugin.data.packing import PackedConversations

    torch.set_num_threads(args.threads)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    vocab = 128
    lengths = conversation_lengths(args.conversations, args.mean_length, args.seq_length, args.seed)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp:
        prefix = Path(tmp) / "chat"
        write_indexed(prefix, [rng.integers(1, vocab, n).astype(np.uint16) for n in lengths])
        write_indexed(f"{prefix}_loss_mask", [np.ones(n, np.uint8) for n in lengths], dtype=np.uint8)
        tokens, mask = read_indexed(prefix), read_indexed(f"{prefix}_loss_mask")
        modes = {name: PackedConversations(tokens, mask, range(len(lengths)), args.seq_length, pack=pack)
                 for name, pack in (("packed", True), ("padded", False))}
        result = _model(args, vocab)
        try:
            seconds = {name: [] for name in modes}
            _epoch(result.engine, modes["packed"], args.micro_batch)   # warm-up
            for _ in range(args.repeats):
                for name, samples in modes.items():
                    seconds[name].append(_epoch(result.engine, samples, args.micro_batch))
        finally:
            result.close()
    rows = []
    for name, samples in modes.items():
        took = statistics.median(seconds[name])
        rows.append({"mode": name, "conversations": len(lengths), "sequences": len(samples),
                     "efficiency": round(samples.efficiency, 4), "seconds": round(took, 3),
                     "real_tokens_per_s": round(samples.real_tokens / took, 1)})
    rows[0]["speedup"] = round(rows[0]["real_tokens_per_s"] / rows[1]["real_tokens_per_s"], 2)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{len(lengths)} conversations, lengths {int(lengths.min())}-{int(lengths.max())} (mean "
              f"{lengths.mean():.1f}), sequences of {args.seq_length}; {args.layers} layers, hidden {args.hidden}, "
              f"{args.experts} experts; median of {args.repeats}")
        print(f"{'mode':8s} {'sequences':>9s} {'efficiency':>10s} {'seconds':>8s} {'real tokens/s':>14s}")
        for row in rows:
            print(f"{row['mode']:8s} {row['sequences']:9d} {row['efficiency']:10.1%} {row['seconds']:8.2f} "
                  f"{row['real_tokens_per_s']:14.0f}")
        print(f"packed / padded real tokens per second: {rows[0]['speedup']:.2f}x")
    return rows
