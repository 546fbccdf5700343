"""``moe-plugin plan``'s flags and their checks; the planning itself is ``moe_plugin.planner.plan``.

The model is the run's DeepSpeed JSON (``--config``) and its shape (``--model-shape`` or Megatron-LM's flags);
``old_model`` converts the old one-file form (``--model``). The planner is imported when the command runs, so
building the command's parser stays light.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_plugin.configs import ConfigError
from moe_plugin.configs.errors import did_you_mean

# ModelShape's fields, each a flag of Megatron-LM's name (--num-layers); PlanOptions' byte fields likewise
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "seq_length")
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
# The old form: each key's place in the new description (part, key). A key it leaves out stays out, so its
# default is the new description's own (MoEConfig's, PlanOptions').
OLD_KEYS = {"layers": ("shape", "num_layers"), "hidden": ("shape", "hidden_size"), "ffn": ("shape", "ffn_hidden_size"),
            "heads": ("shape", "num_attention_heads"), "vocab": ("shape", "vocab_size"),
            "seq": ("shape", "seq_length"), "experts": ("moe", "num_experts"), "top_k": ("moe", "top_k"),
            "capacity_factor": ("moe", "capacity_factor"), "moe_layer_interval": ("moe", "layer_interval"),
            "expert_ffn": ("moe", "ffn_hidden_size"), "global_batch": ("ds", "train_batch_size"),
            "micro_batches": ("options", "micro_batches"), **{k: ("options", k) for k in BYTE_KEYS}}
# an error of the converted description, named by the old form's key
OLD_PATHS = {(new if part == "ds" else f"{part}.{new}"): f"model.{old}" for old, (part, new) in OLD_KEYS.items()}


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="search parallel layouts with the cost model and write a candidate "
                               "pool of DeepSpeed JSONs (also: --calibrate, --validate)",
                               description="See docs/planner.md.")
    plan.add_argument("--config", type=Path, metavar="DS.json", help="the run's DeepSpeed JSON: its \"moe\" block, "
                      "train_batch_size and precision, read as the run reads them; each candidate is this JSON "
                      "with its own layout")
    plan.add_argument("--model-shape", type=Path, metavar="SHAPE.json", help="the model's shape: a JSON of the "
                      "shape flags' names (num_layers, hidden_size, ...), instead of the flags")
    plan.add_argument("--cluster", type=Path, help="cluster JSON, or a calibration written by --calibrate")
    shape = plan.add_argument_group("model shape (Megatron-LM's flags, as examples/gpt_moe/pretrain_gpt_moe.py "
                                    "takes them)")
    for key in SHAPE_KEYS:
        shape.add_argument(_flag(key), type=int, metavar="N")
    options = plan.add_argument_group("planner options")
    options.add_argument("--micro-batches", metavar="B,B,...", help="micro-batch sizes (sequences per rank) to "
                         "try (default 1,2,4,8)")
    for key in BYTE_KEYS:
        options.add_argument(_flag(key), type=int, metavar="N", help="default: by the JSON's precision, bf16/fp16 "
                             "or fp32 (docs/planner.md)")
    plan.add_argument("--model", type=Path, metavar="MODEL.json", help="the old form: one JSON of the whole model "
                      "(layers, hidden, ..., experts, global_batch), converted into --config and the shape")
    plan.add_argument("--trace", type=Path, help="gate trace (moe_plugin.placement.trace) for the load profile")
    plan.add_argument("--out", type=Path, default=Path("plan_out"), help="output folder (default plan_out)")
    plan.add_argument("--top", type=int, default=5, help="pool size (default 5)")
    plan.add_argument("--world-size", type=int, help="ranks to plan for (default: the cluster's)")
    plan.add_argument("--policy-interval", type=int, default=100, help="steps between greedy placement checks "
                      "in the trace replay (default 100)")
    plan.add_argument("--replica-budget", type=int, default=0, metavar="K", help="with --trace: also replay "
                      "greedy placement with up to K shadow experts per MoE layer, and put replica_budget K "
                      "into the JSONs of members where that is faster (default 0: no shadowing)")
    plan.add_argument("--calibrate", type=Path, metavar="OUT.json", help="measure GEMM throughput and gloo "
                      "collectives on this machine and write a cluster JSON")
    plan.add_argument("--validate", action="store_true", help="predicted vs measured step time of CPU layouts "
                      "of a tiny GPT-MoE on gloo ranks")
    plan.add_argument("--ranks", default="4", help="ranks for --calibrate (one number) or --validate "
                      "(comma-separated, default 4)")
    plan.add_argument("--calibration", type=Path, help="--validate: use this calibration instead of measuring")
    plan.add_argument("--rounds", type=int, default=4, help="--validate: timed steps per layout (default 4)")
    plan.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    """``moe-plugin plan``: calibrate, validate, or check the flags and plan."""
    if args.calibrate is not None:
        from moe_plugin.planner.calibrate import calibrate

        calibrate(args.calibrate, _positive_list("--ranks", args.ranks)[0])
        return
    if args.validate:
        from moe_plugin.planner.validate import validate

        validate(_positive_list("--ranks", args.ranks), args.out, args.calibration, args.rounds)
        return
    if args.cluster is None:
        raise ConfigError("--cluster", None, "required to plan (or use --calibrate / --validate)")
    if args.top < 1:
        raise ConfigError("--top", args.top, "expected a positive integer")
    if args.replica_budget < 0:
        raise ConfigError("--replica-budget", args.replica_budget, "expected 0 (no shadow experts) or a positive "
                          "integer")
    if args.replica_budget and args.trace is None:
        raise ConfigError("--replica-budget", args.replica_budget, "needs --trace (the trace replay decides it)")
    from moe_plugin.planner.plan import plan
    from moe_plugin.planner.spec import ClusterSpec

    model = plan_model(args)
    if args.replica_budget > model.moe.num_experts:
        raise ConfigError("--replica-budget", args.replica_budget, f"must be at most moe.num_experts "
                          f"({model.moe.num_experts})")
    plan(model, ClusterSpec.load(args.cluster), args.out, top=args.top, trace=args.trace,
         world_size=args.world_size, interval=args.policy_interval, replica_budget=args.replica_budget)


def plan_model(args: argparse.Namespace):
    """The ``PlanModel`` of the flags: ``--config`` with ``--model-shape`` or the shape flags, or the old ``--model``;
    an error names the flag (or the file's key)."""
    from moe_plugin.planner.spec import PlanModel

    shape = {k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None}
    options = {k: getattr(args, k) for k in BYTE_KEYS if getattr(args, k) is not None}
    if args.micro_batches is not None:
        options["micro_batches"] = _positive_list("--micro-batches", args.micro_batches)
    if args.model is not None:
        mixed = [f for f, v in (("--config", args.config), ("--model-shape", args.model_shape)) if v is not None]
        mixed += [_flag(k) for k in (*shape, *options)]
        if mixed:
            raise ConfigError("--model", str(args.model), f"is the old form, whose JSON holds the whole model: give "
                              f"it without {mixed[0]}, or --config with the shape instead of it")
        ds, shape, options = old_model(args.model)
        return _renamed(lambda: PlanModel.build(ds, shape, options), OLD_PATHS)
    if args.config is None:
        raise ConfigError("--config", None, "required to plan: the run's DeepSpeed JSON, with --model-shape or the "
                          "shape flags (or the old form --model MODEL.json)")
    if args.model_shape is not None and shape:
        raise ConfigError(_flag(next(iter(shape))), next(iter(shape.values())), "--model-shape gives the shape "
                          "already; give either it or the shape flags")
    if args.model_shape is None and not shape:
        raise ConfigError("--model-shape", None, f"required to plan: the model's shape as a JSON, or the flags "
                          f"{', '.join(_flag(k) for k in SHAPE_KEYS)}")
    flags = {f"options.{k}": _flag(k) for k in (*BYTE_KEYS, "micro_batches")}
    if shape:
        flags.update({f"shape.{k}": _flag(k) for k in SHAPE_KEYS})
    return _renamed(lambda: PlanModel.build(args.config, args.model_shape or shape, options), flags)


def old_model(path: Path) -> tuple[dict, dict, dict]:
    """The old form's JSON as (the DeepSpeed JSON, the shape, the options) of the new description."""
    from moe_plugin.planner.spec import BYTES

    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("--model", str(path), f"cannot be read as JSON ({err})") from None
    if not isinstance(old, dict):
        raise ConfigError("model", old, "expected a JSON object with the old form's keys")
    parts: dict = {"ds": {}, "moe": {}, "shape": {}, "options": {}}
    for key, value in old.items():
        if key not in OLD_KEYS:
            raise ConfigError(f"model.{key}", value, f"unknown key{did_you_mean(key, OLD_KEYS)}; the old form's "
                              f"keys: {', '.join(OLD_KEYS)}")
        part, new = OLD_KEYS[key]
        parts[part][new] = value
    moe = parts["moe"]
    if "capacity_factor" in moe and moe["capacity_factor"] is None:    # null was dropless
        del moe["capacity_factor"]
        moe["drop_tokens"] = False
    if moe.get("top_k") is not None:
        moe["router"] = {1: "switch", 2: "gshard"}.get(moe["top_k"], "topk")
    half = BYTES["half"]    # the old form's byte defaults; its param_bytes 2 meant bf16
    options = {**half, **parts["options"]}
    ds = {**parts["ds"], "moe": moe}
    if options["param_bytes"] == half["param_bytes"]:
        ds["bf16"] = {"enabled": True}
    return ds, parts["shape"], options


def _renamed(build, paths: dict):
    """``build()``, its ``ConfigError`` named by ``paths`` (a key path to the flag or key the user wrote)."""
    try:
        return build()
    except ConfigError as err:
        path = paths.get(err.path.split("[")[0])
        if path is None:
            raise
        raise ConfigError(path, err.value, err.expected, err.shown) from None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _positive_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(flag, text, "expected comma-separated positive integers, e.g. 4,8")
    return values
