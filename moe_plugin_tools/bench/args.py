"""Command-line arguments of ``moe-plugin bench``; importing this module does not import torch."""
from __future__ import annotations

import argparse
from pathlib import Path

CHECKPOINT_STEPS = ("import-hf", "export-hf", "export", "load", "save")   # bench checkpoint's, in order


def _number_list(text: str, parse, least, noun: str, bounded: str) -> list:
    """``text`` as comma-separated ``parse`` values, each at least ``least``."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected comma-separated {bounded}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    return _number_list(text, int, 1, "integers", "positive integers")


def float_list(text: str) -> list[float]:
    return _number_list(text, float, 0, "numbers", "numbers >= 0")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` (moe_plugin_tools/bench/device.py)."""
    parser.add_argument("--device", default=None, help="torch device to run on (default: DeepSpeed's "
                        "accelerator's: cpu here, cuda on NVIDIA GPUs)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="default fp32")


def add_bench_parser(commands: argparse._SubParsersAction, run_layer, run_step=None, run_checkpoint=None,
                     run_packing=None) -> None:
    """Add ``bench layer`` (and ``bench step``, ``bench checkpoint`` when ``run_step``, ``run_checkpoint``
    are given) to the ``moe-plugin`` subcommands; ``run_layer(args)`` / ``run_step(args)`` /
    ``run_checkpoint(args)`` run them."""
    bench = commands.add_parser("bench", help="benchmarks (bench layer: our MoE layer vs DeepSpeed's; bench step: "
                                "whole training steps of a GPT-MoE vs the same GPT with DeepSpeed's MoE; bench "
                                "checkpoint: the model conversions' time and peak memory)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    layer = kinds.add_parser("layer", help="forward+backward time and peak memory of the MoE layer, of DeepSpeed's "
                             "MoE layer and of the expert GEMMs alone (the floor)",
                             description="One line per configuration (one JSON object with --json). "
                             "See docs/benchmarks.md.")
    layer.add_argument("--experts", type=int_list, default=[8, 64, 128], help="comma-separated expert counts "
                       "(default 8,64,128)")
    layer.add_argument("--tokens", type=positive_int, default=4096, help="tokens per batch (default 4096)")
    layer.add_argument("--hidden", type=positive_int, default=512, help="hidden size H (default 512)")
    layer.add_argument("--ffn", type=positive_int, default=1024, help="expert FFN size F (default 1024)")
    layer.add_argument("--top-k", type=positive_int, default=2, help="experts per token (default 2: gshard)")
    layer.add_argument("--capacity-factor", type=float, default=1.25, help="default 1.25")
    layer.add_argument("--dropless", action="store_true", help="no capacity (DeepSpeed: capacity = largest load)")
    layer.add_argument("--skew", type=float_list, default=[0.0], help="comma-separated routing skews: std of a "
                       "per-expert logit offset (default 0; at 64 experts 0.1 makes the largest load 3.4x the mean)")
    layer.add_argument("--vs", choices=["deepspeed", "megatron", "none"], default="none",
                       help="also run DeepSpeed's MoE layer (--vs deepspeed) or Megatron-Core's (--vs megatron: "
                       "alltoall dispatcher, grouped GEMM; CUDA only)")
    layer.add_argument("--iters", type=positive_int, default=5, help="timed iterations (default 5)")
    layer.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    layer.add_argument("--breakdown", action="store_true", help="also time our layer's parts alone "
                       "(router, top-k, argsort, permute, experts, combine): ours_parts_ms")
    layer.add_argument("--recompute-pre-activation", action="store_true", help="our experts keep no "
                       "pre-activation for backward and recompute it (one more GEMM; less memory)")
    layer.add_argument("--overlap-chunks", type=positive_int, default=1, help="with --ep > 1: our layer's "
                       "moe.overlap_chunks, the exchange in chunks overlapped with the experts (default 1)")
    layer.add_argument("--group-topk", type=positive_int, default=None, help="our layer's moe.group_topk: each "
                       "token's experts come from its best M expert groups (default: no limit; needs --vs none)")
    layer.add_argument("--exchange", choices=["counts", "padded", "token"], default="counts", help="with --ep > 1: "
                       "our layer's moe.exchange (token: each token sent once per destination rank; default counts)")
    layer.add_argument("--router-groups", type=positive_int, default=None, help="our layer's moe.router_groups "
                       "with --group-topk (default: --ep, one group per EP rank)")
    layer.add_argument("--threads", type=positive_int, default=2, help="torch.set_num_threads (default 2)")
    layer.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True) "
                       "while the layers run (what a reproducible GPU run sets; its cost here)")
    layer.add_argument("--seed", type=int, default=0)
    layer.add_argument("--ep", type=positive_int, default=1, help="expert-parallel ranks: starts N gloo "
                       "processes (or is one rank under a launcher); --tokens is per rank (default 1)")
    layer.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    add_target_args(layer)
    layer.set_defaults(run=run_layer)
    if run_step is not None:
        add_step_parser(kinds, run_step)
    if run_checkpoint is not None:
        add_checkpoint_parser(kinds, run_checkpoint)
    if run_packing is not None:
        add_packing_parser(kinds, run_packing)


def add_step_parser(kinds: argparse._SubParsersAction, run_step) -> None:
    """``bench step``: see moe_plugin_tools/bench/step.py and docs/benchmarks.md."""
    step = kinds.add_parser("step", help="whole training step (forward, backward, optimizer) of a tiny Megatron GPT "
                            "with our MoE layers vs the same GPT with DeepSpeed's MoE layers, alternating",
                            description="One line (one JSON object with --json) from rank 0. "
                            "See docs/benchmarks.md.")
    step.add_argument("--ranks", type=positive_int, default=4, help="gloo ranks to start (or, under a launcher, "
                      "its WORLD_SIZE; default 4)")
    step.add_argument("--ep", type=positive_int, default=None, help="expert-parallel size (default: --ranks)")
    step.add_argument("--layers", type=positive_int, default=4, help="transformer layers (default 4)")
    step.add_argument("--moe-every", type=positive_int, default=2, help="layer i is MoE when i %% N == 0 "
                      "(default 2: layers 0, 2)")
    step.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default 256)")
    step.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    step.add_argument("--ffn", type=positive_int, default=1024, help="FFN size of dense MLPs and experts "
                      "(default 1024)")
    step.add_argument("--experts", type=positive_int, default=8, help="experts per MoE layer (default 8)")
    step.add_argument("--top-k", type=positive_int, default=2, choices=[1, 2], help="default 2")
    step.add_argument("--capacity-factor", type=float, default=1.25, help="default 1.25")
    step.add_argument("--min-capacity", type=int, default=4, help="default 4")
    step.add_argument("--dropless", action="store_true", help="no capacity (DeepSpeed: capacity = largest load)")
    step.add_argument("--seq", type=positive_int, default=256, help="sequence length (default 256)")
    step.add_argument("--micro-batch", type=positive_int, default=4, help="sequences per rank (default 4)")
    step.add_argument("--vocab", type=positive_int, default=4096, help="vocabulary size (default 4096)")
    step.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=1, help="default 1")
    step.add_argument("--rounds", type=positive_int, default=5, help="timed rounds, each one step of both "
                      "models (default 5)")
    step.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    step.add_argument("--parts", type=int, default=0, help="after the timed rounds, profile this many more steps of "
                      "each model and add where their time goes (attention, MLPs, the MoE layers' parts, collectives, "
                      "optimizer; mean over the ranks, ms per step) to the record, and what one more collective round costs in "
                      "our step (ours_extra_round_ms: 2 x this many steps, with and without 2 tiny all-to-alls before "
                      "each MoE layer) (default 0: off)")
    step.add_argument("--threads", type=positive_int, default=2, help="threads of the whole job, split over the "
                      "ranks (default 2)")
    step.add_argument("--seed", type=int, default=0)
    step.add_argument("--json", action="store_true", help="print one JSON object")
    add_target_args(step)
    step.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)   # the deepspeed launcher passes it
    step.set_defaults(run=run_step)


def add_checkpoint_parser(kinds: argparse._SubParsersAction, run_checkpoint) -> None:
    """``bench checkpoint``: see moe_plugin_tools/bench/checkpoint.py. The sizes are checked there, each
    refusal one line naming its flag (no argparse type: its refusals come with the usage)."""
    ckpt = kinds.add_parser("checkpoint", help="time, peak memory and bytes of import-hf, export-hf and export on "
                            "generated Mixtral-shaped Hugging Face models, each run as a user runs it",
                            description="One row per model size and step (one JSON object with --json); progress "
                            "on stderr. See moe_plugin_tools/bench/checkpoint.py.")
    ckpt.add_argument("--layers", default="4,8", help="comma-separated layer counts, one model each (default 4,8)")
    ckpt.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    ckpt.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    ckpt.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    ckpt.add_argument("--experts", type=int, default=8, help="experts per layer, a multiple of 2 (default 8)")
    ckpt.add_argument("--ffn", type=int, default=3584, help="expert FFN size (default 3584: 364M parameters at "
                      "4 layers)")
    ckpt.add_argument("--vocab", type=int, default=384, help="vocabulary size (default 384)")
    ckpt.add_argument("--steps", default=",".join(CHECKPOINT_STEPS), help="comma-separated steps to measure "
                      f"(default {','.join(CHECKPOINT_STEPS)})")
    ckpt.add_argument("--work", type=Path, default=None, help="where the models and outputs go (default: a "
                      "temporary directory, removed at the end)")
    ckpt.add_argument("--keep", action="store_true", help="keep the models and outputs (default: removed when done)")
    ckpt.add_argument("--settle", type=float, default=3.0, help="seconds idle after sync before each measured "
                      "command and copy, so that all start from the same state of memory (default 3)")
    ckpt.add_argument("--json", action="store_true", help="print one JSON object per row")
    ckpt.set_defaults(run=run_checkpoint)


def parse_step_args(argv: list[str]) -> argparse.Namespace:
    """``moe-plugin bench step``'s arguments without the rest of the command (``python -m
    moe_plugin_tools.bench.step ...`` under a launcher)."""
    parser = argparse.ArgumentParser(prog="moe-plugin bench")
    add_step_parser(parser.add_subparsers(dest="bench", required=True), run_step=None)
    return parser.parse_args(["step", *argv])


def add_packing_parser(kinds: argparse._SubParsersAction, run_packing) -> None:
    bench = kinds.add_parser("packing", help="packed conversations vs one conversation per padded sequence: "
                             "packing efficiency and real tokens/s of training steps",
                             description="Packed conversations against one conversation per padded sequence, side by side "
                             "in one run (docs/fine_tuning.md).")
    bench.add_argument("--conversations", type=positive_int, default=256, help="default 256")
    bench.add_argument("--mean-length", type=positive_int, default=48, help="mean conversation length (default 48)")
    bench.add_argument("--seq-length", type=positive_int, default=256, help="default 256")
    bench.add_argument("--micro-batch", type=positive_int, default=4, help="sequences per step (default 4)")
    bench.add_argument("--layers", type=positive_int, default=2, help="default 2")
    bench.add_argument("--hidden", type=positive_int, default=64, help="default 64")
    bench.add_argument("--experts", type=positive_int, default=4, help="default 4")
    bench.add_argument("--repeats", type=positive_int, default=3, help="rounds of both modes (default 3)")
    bench.add_argument("--threads", type=positive_int, default=2, help="torch.set_num_threads (default 2)")
    bench.add_argument("--seed", type=int, default=0, help="the lengths and tokens (default 0)")
    bench.add_argument("--json", action="store_true", help="one JSON object per mode")
    bench.set_defaults(run=run_packing)
