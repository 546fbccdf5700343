"""The ``moe-plugin`` command: check a config, print a rank layout, show the demo layout.

    moe-plugin check-config ds_config.json [--world-size N]
    moe-plugin layout --world-size 8 --tp 2 --pp 2 --ep 2 [--etp 1] [--order tp-cp-ep-dp-pp] [--json]
    moe-plugin demo [--world-size 4] [--config FILE]
    moe-plugin bench layer [--experts 8,64,128] [--tokens N] [--vs deepspeed] [--dropless] [--json] ...
    moe-plugin bench step [--ranks 4] [--ep N] [--layers 4] [--hidden 256] [--experts 8] [--json] ...
    moe-plugin bench checkpoint [--layers 4,8] [--hidden 1024] [--experts 8] [--steps import-hf,export] [--json] ...
    moe-plugin bench packing [--conversations 256] [--mean-length 48] [--seq-length 256] [--json] ...
    moe-plugin plan --config ds.json --model-shape SHAPE.json --cluster CLUSTER.json [--trace FILE] [--out DIR]
    moe-plugin plan --config ds.json --num-layers N --hidden-size H ... --cluster CLUSTER.json [--top N]
    moe-plugin plan --calibrate out.json [--ranks 4] | --validate [--ranks 4,8]
    moe-plugin report RUN_DIR [RUN_DIR ...] [--out DIR]
    moe-plugin export CKPT_DIR --out DIR [--tag TAG] [--trust-checkpoint]
    moe-plugin upcycle DENSE_CKPT --config ds.json --out MOE_CKPT [--granularity G] [--tag TAG] [--reset-iteration]
    moe-plugin import-hf HF_DIR --config ds.json --out CKPT [--tag TAG] [--dtype float32] [--config-out JSON]
    moe-plugin export-hf CKPT --out HF_DIR [--arch MODEL_TYPE] [--max-shard-size 5GB]
    moe-plugin preprocess --input FILE.jsonl --tokenizer HF_DIR --output-prefix P [--json-keys text] [--workers N]
    moe-plugin preprocess --chat --input FILE.jsonl --tokenizer HF_DIR --output-prefix P [--chat-key messages]
    moe-plugin train-tokenizer --input FILE.jsonl --out HF_DIR [--vocab-size 4096]
    moe-plugin stdlib-jsonl OUT.jsonl [--corpus-bytes N]

A bad config or bad sizes exit with status 2 and one line ``error: <message>`` on stderr (rank 0
only, when started by a launcher). ``check-config`` with a world size also checks DeepSpeed's
batch arithmetic; sizes past 2^20 (ranks, experts) are refused at once.
Nothing here creates a process group or imports torch.distributed (``bench`` imports torch when run).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from moe_plugin_tools.bench.args import add_bench_parser
from moe_plugin.checkpoint.trust import TRUST_HELP
from moe_plugin.configs import ConfigError, MoEConfig, batch_sizes
from moe_plugin.configs.report import exit_on_config_error
from moe_plugin.configs.schema import DEFAULT_ORDER, load_ds_config
from moe_plugin.groups.layout import RankLayout
from moe_plugin_tools.layout_views import group_lists, rank_groups
from moe_plugin_tools.plan_args import add_plan_parser
from moe_plugin_tools.report import write_report
from moe_plugin_tools.text_args import add_text_parsers

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json"
# `layout` takes sizes as flags; name the flag, not the config key, in its errors.
FLAG_OF_KEY = {"world_size": "--world-size", "moe.num_experts": "--ep", "moe.parallel.tensor": "--tp",
               "moe.parallel.pipeline": "--pp", "moe.parallel.expert": "--ep", "moe.parallel.expert_tensor": "--etp",
               "moe.parallel.order": "--order"}


def check_config(args: argparse.Namespace) -> None:
    ds_config = load_ds_config(args.file)
    config = MoEConfig.from_ds_config(ds_config)
    world_size = args.world_size if args.world_size is not None else _env_world_size()
    sizes = config.check_world_size(world_size) if world_size is not None else None  # check all, then print
    if sizes is not None:
        batch_sizes(ds_config, sizes.dp)
    print(json.dumps(config.resolved_dict(), indent=2))
    if sizes is not None:
        print()
        print(RankLayout(sizes).table())


def layout(args: argparse.Namespace) -> None:
    try:
        rank_layout = RankLayout.build(args.world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                       order=args.order)
    except ConfigError as err:
        raise ConfigError(FLAG_OF_KEY.get(err.path, err.path), err.value, err.expected) from None
    if args.json:
        print(json.dumps(rank_layout.to_json()))
    else:
        print(rank_layout.table())
        print()
        print(group_lists(rank_layout))


def demo(args: argparse.Namespace) -> None:
    config = MoEConfig.from_ds_config(args.config)
    p = config.parallel
    _section(f"Example config {args.config.name}: {config.num_experts} experts, router {config.router} "
             f"(top-{config.k}), tensor {p.tensor}, pipeline {p.pipeline}, expert {p.expert}")
    _show_layout(RankLayout(config.check_world_size(args.world_size)))
    per_rank = config.num_experts // p.expert
    print("\nStatic placement: " + ", ".join(f"ep rank {e} hosts experts {_span(e * per_rank, per_rank)}"
                                             for e in range(p.expert)))
    _section("Folded: tensor 2, expert 2, expert_tensor 1 (EP carved out of the TP ranks)")
    _show_layout(RankLayout.build(args.world_size, tp=2, ep=2, etp=1))


def bench_layer(args: argparse.Namespace) -> None:
    from moe_plugin_tools.bench.layer_ep import run

    run(args)


def bench_step(args: argparse.Namespace) -> None:
    from moe_plugin_tools.bench.step import run

    run(args)


def bench_checkpoint(args: argparse.Namespace) -> None:
    from moe_plugin_tools.bench.checkpoint import run

    run(args)


def bench_packing(args: argparse.Namespace) -> None:
    from moe_plugin_tools.bench.packing import run

    run(args)


def _span(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def _section(title: str) -> None:
    print(f"\n== {title}")


def report(args: argparse.Namespace) -> None:
    for path in write_report(args.run_dirs, args.out):
        print(path)


def export(args: argparse.Namespace) -> None:
    from moe_plugin.checkpoint import export_checkpoint

    export_checkpoint(args.checkpoint, args.out, tag=args.tag, progress=lambda line: print(line, flush=True),
                      trust=args.trust_checkpoint)


def upcycle(args: argparse.Namespace) -> None:
    from moe_plugin.checkpoint import upcycle_checkpoint

    done = upcycle_checkpoint(args.checkpoint, args.config, args.out, tag=args.tag, granularity=args.granularity,
                              keep_iteration=not args.reset_iteration, drop_mlp_bias=args.drop_mlp_bias,
                              allow_inexact=args.allow_inexact, seed=args.seed,
                              progress=lambda line: print(line, flush=True), trust=args.trust_checkpoint)
    copies = done.num_experts // done.granularity
    print(f"upcycled {done.source} -> {done.path}\n"
          f"  MoE layers {list(done.moe_layers)}: {done.num_experts} experts each = {copies} copies of the dense MLP"
          + (f" x {done.granularity} pieces" if done.granularity > 1 else "") + "\n"
          f"  resumes at step {done.global_steps}; optimizer state fresh"
          + (f"; dropped {len(done.dropped_biases)} MLP biases" if done.dropped_biases else ""))


def import_hf(args: argparse.Namespace) -> None:
    from moe_plugin.interop import import_hf as run

    done = run(args.hf_dir, args.config, args.out, tag=args.tag, dtype=args.dtype, config_out=args.config_out,
               progress=lambda line: print(line, flush=True), trust=args.trust_checkpoint)
    print(f"imported {args.hf_dir} ({done.model_type}) -> {done.path} in {done.seconds:.2f} s")
    if done.filled:
        print(f"  filled in from config.json: moe.{', moe.'.join(done.filled)}; the \"moe\" block to train with:\n"
              f"  \"moe\": {json.dumps(done.moe_block)}")
    print(f"  the DeepSpeed JSON to train with (yours, its \"moe\" block completed): {done.config_path}")
    print("  the example's model flags (recorded in the checkpoint; a load with others is refused):\n"
          f"  --load {args.out} {' '.join(done.flags)}")
    if "PREFIX" in done.command:
        print("  its vocabulary is not the example's byte corpus's: tokenize your data with the imported tokenizer "
              f"first,\n  moe-plugin preprocess --input FILE.jsonl --tokenizer {done.command[-1]} "
              "--output-prefix PREFIX")
    print(f"  train it (from the repository's root; add --train-iters, --save ...):\n  {shlex.join(done.command)}")
    if has_chat_template(args.hf_dir):
        print("  its tokenizer has a chat template: to fine-tune on conversations, moe-plugin preprocess --chat, then "
              "the command above with --finetune\n  (docs/fine_tuning.md)")


def has_chat_template(hf_dir: str) -> bool:
    """Whether the Hugging Face directory's tokenizer carries a chat template (``chat_template.jinja`` or the
    ``chat_template`` of ``tokenizer_config.json``)."""
    from pathlib import Path

    directory = Path(hf_dir)
    if (directory / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def export_hf(args: argparse.Namespace) -> None:
    from moe_plugin.interop import export_hf as run

    done = run(args.checkpoint, args.out, arch=args.arch, tag=args.tag, max_shard_size=args.max_shard_size,
               dtype=args.dtype, progress=lambda line: print(line, flush=True), trust=args.trust_checkpoint)
    print(f"exported {args.checkpoint} -> {done['path']} ({done['model_type']}, {len(done['files'])} files) in "
          f"{done['seconds']:.2f} s")


def _show_layout(rank_layout: RankLayout) -> None:
    print(rank_layout.table())
    print("\nGroups each rank joins:")
    print(rank_groups(rank_layout))


def _env_world_size() -> Optional[int]:
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ConfigError("WORLD_SIZE (environment)", value, "expected a positive integer")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-plugin", description="Hybrid expert parallelism for "
                                     "Megatron-Core GPT on DeepSpeed: config and layout tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser("check-config", help="validate the \"moe\" block of a DeepSpeed JSON")
    check.add_argument("file", type=Path, help="DeepSpeed JSON config with a \"moe\" block")
    check.add_argument("--world-size", type=int, help="also check the sizes and print the rank layout "
                       "(default: $WORLD_SIZE when set)")
    check.set_defaults(run=check_config)

    sizes = commands.add_parser("layout", help="print the rank layout and groups for given sizes")
    sizes.add_argument("--world-size", type=int, required=True)
    sizes.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    sizes.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    sizes.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    sizes.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    sizes.add_argument("--order", default=DEFAULT_ORDER, help=f"rank order (default: {DEFAULT_ORDER})")
    sizes.add_argument("--json", action="store_true", help="print the group lists as one JSON object")
    sizes.set_defaults(run=layout)

    example = commands.add_parser("demo", help="show the layout of the example 4-rank config, and a folded one")
    example.add_argument("--world-size", type=int, default=4)
    example.add_argument("--config", type=Path, default=DEMO_CONFIG, help="DeepSpeed JSON to show "
                         "(default: examples/gpt_moe/configs/tiny_cpu_4rank.json)")
    example.set_defaults(run=demo)

    runs = commands.add_parser("report", help="tables (report.md) and plots of GPT-MoE example run directories")
    runs.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a --run-dir of the example")
    runs.add_argument("--out", type=Path, default=None, help="where to write (default: the first RUN_DIR)")
    runs.set_defaults(run=report)

    dump = commands.add_parser("export", help="a checkpoint of any layout as one fp32 state dict of the 1-rank "
                               "GPTModel (safetensors) and its config (JSON)")
    dump.add_argument("checkpoint", type=Path, metavar="CKPT_DIR", help="a --save directory (moe_plugin checkpoint)")
    dump.add_argument("--out", type=Path, required=True, help="where model.safetensors and config.json go")
    dump.add_argument("--tag", default=None, help="the tag to export (default: the one CKPT_DIR/latest names)")
    dump.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    dump.set_defaults(run=export)

    up = commands.add_parser("upcycle", help="an MoE checkpoint whose experts start as copies of a dense "
                             "checkpoint's MLPs (loads under any layout)")
    up.add_argument("checkpoint", type=Path, metavar="DENSE_CKPT", help="a --save directory of a dense model")
    up.add_argument("--config", type=Path, required=True, help="the MoE model's DeepSpeed JSON (its \"moe\" block)")
    up.add_argument("--out", type=Path, required=True, help="the MoE checkpoint directory to write (a --load)")
    up.add_argument("--granularity", type=int, default=1, help="cut each copy into G experts of FFN/G "
                    "(num_experts = copies x G, gate_scale G, top_k a multiple of G)")
    up.add_argument("--tag", default=None, help="the dense tag (default: the one DENSE_CKPT/latest names)")
    up.add_argument("--reset-iteration", action="store_true", help="start at step 0 with the lr schedule "
                    "as built (default: continue the dense run's step, lr schedule and data order)")
    up.add_argument("--drop-mlp-bias", action="store_true", help="drop the dense MLPs' biases (experts have "
                    "none; the function changes by them)")
    up.add_argument("--allow-inexact", action="store_true", help="accept gates that do not reproduce the dense "
                    "MLP at step 0 (unnormalised, switch, ...): warn instead of refusing")
    up.add_argument("--seed", type=int, default=1234, help="seed of the fresh router weights")
    up.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    up.set_defaults(run=upcycle)

    imp = commands.add_parser("import-hf", help="a Hugging Face model directory (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, "
                              "GLM-4.5, DeepSeek-V3, DeepSeek-V2, GPT-OSS; dense Llama, Mistral, Qwen3) as a "
                              "checkpoint that loads under any layout")
    imp.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="config.json and model.safetensors (or its index)")
    imp.add_argument("--config", type=Path, required=True, help="the DeepSpeed JSON to train with; its \"moe\" "
                     "block is checked against config.json (expert fields left out are filled in)")
    imp.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (a --load)")
    imp.add_argument("--tag", default="step0", help="the tag to write (default: step0)")
    imp.add_argument("--config-out", type=Path, default=None, help="where to write the DeepSpeed JSON to train with "
                     "(--config with its \"moe\" block completed; default: OUT/ds_config.json)")
    imp.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's own, so a "
                     "bf16 model makes a checkpoint of its own size)")
    imp.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    imp.set_defaults(run=import_hf)

    exp = commands.add_parser("export-hf", help="a checkpoint of any layout as a Hugging Face model directory "
                              "(transformers' AutoModelForCausalLM loads it)")
    exp.add_argument("checkpoint", type=Path, metavar="CKPT", help="a --save directory (moe_plugin checkpoint)")
    exp.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    from moe_plugin.interop.families import MODEL_TYPES

    exp.add_argument("--arch", default=None, help=", ".join(MODEL_TYPES[:-1]) + f" or {MODEL_TYPES[-1]} (default: "
                     "the imported model's, else inferred from the checkpoint)")
    exp.add_argument("--tag", default=None, help="the tag to export (default: the one CKPT/latest names)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest weights file (default 5GB); more are indexed")
    exp.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the imported model's, "
                     "else float32)")
    exp.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    exp.set_defaults(run=export_hf)

    add_bench_parser(commands, bench_layer, bench_step, bench_checkpoint, bench_packing)
    add_plan_parser(commands)
    add_text_parsers(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    with exit_on_config_error(ValueError):   # bad input, not a bug: one line (rank 0 under a launcher), status 2
        args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
