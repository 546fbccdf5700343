"""``moe-plugin plan``'s flags and their checks; the planning itself is ``moe_plugin.planner.plan``.

The planner is imported when the command runs, so building the command's parser stays light.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from moe_plugin.configs import ConfigError


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="search parallel layouts with the cost model and write a candidate "
                               "pool of DeepSpeed JSONs (also: --calibrate, --validate)",
                               description="See docs/planner.md.")
    plan.add_argument("--model", type=Path, help="model JSON (examples/gpt_moe/planner/*.json)")
    plan.add_argument("--cluster", type=Path, help="cluster JSON, or a calibration written by --calibrate")
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

        calibrate(args.calibrate, _ranks(args.ranks)[0])
        return
    if args.validate:
        from moe_plugin.planner.validate import validate

        validate(_ranks(args.ranks), args.out, args.calibration, args.rounds)
        return
    for flag in ("model", "cluster"):
        if getattr(args, flag) is None:
            raise ConfigError(f"--{flag}", None, "required to plan (or use --calibrate / --validate)")
    if args.top < 1:
        raise ConfigError("--top", args.top, "expected a positive integer")
    if args.replica_budget < 0:
        raise ConfigError("--replica-budget", args.replica_budget, "expected 0 (no shadow experts) or a positive "
                          "integer")
    if args.replica_budget and args.trace is None:
        raise ConfigError("--replica-budget", args.replica_budget, "needs --trace (the trace replay decides it)")
    from moe_plugin.planner.plan import plan
    from moe_plugin.planner.spec import ClusterSpec, ModelSpec

    model = ModelSpec.load(args.model)
    if args.replica_budget > model.experts:
        raise ConfigError("--replica-budget", args.replica_budget, f"must be at most model.experts ({model.experts})")
    plan(model, ClusterSpec.load(args.cluster), args.out, top=args.top, trace=args.trace,
         world_size=args.world_size, interval=args.policy_interval, replica_budget=args.replica_budget)


def _ranks(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError("--ranks", text, "expected comma-separated positive integers, e.g. 4,8")
    return values
