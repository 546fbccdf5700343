"""One run reduced to the numbers of its report row: model flags, parameters, losses, speed, balance."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from moe_plugin.report.params import ParamCount, count_params, top_k_of
from moe_plugin.report.rundir import Run


@dataclass(frozen=True)
class RunSummary:
    """The row of one run. A value the run did not record is None (shown as "-")."""

    name: str
    layers: Optional[int]
    hidden: Optional[int]
    heads: Optional[int]
    ffn: Optional[int]
    seq: Optional[int]
    experts: Optional[int]
    top_k: Optional[int]
    layout: str                       # "tp1 pp1 ep2 etp1" from the "moe" block's parallel sizes
    world_size: Optional[int]
    params: Optional[ParamCount]
    steps: int                        # last training step
    final_train_loss: float
    best_valid_loss: Optional[float]
    final_valid_loss: Optional[float]
    median_tokens_per_s: Optional[float]
    median_step_s: Optional[float]
    final_imbalance: Optional[float]
    final_dropped_fraction: Optional[float]
    wall_s: Optional[float]           # largest elapsed_s of any record


def layout_of(moe: dict) -> str:
    parallel = moe.get("parallel", {})
    tp = parallel.get("tensor", 1)
    etp = parallel.get("expert_tensor") or tp
    return f"tp{tp} pp{parallel.get('pipeline', 1)} ep{parallel.get('expert', 1)} etp{etp}"


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(run: Run) -> RunSummary:
    args, moe = run.args, run.moe
    last = max(run.train, key=lambda r: r["step"])
    logged = run.logged
    final_log = max(logged, key=lambda r: r["step"]) if logged else {}
    valid = sorted(run.valid, key=lambda r: r["step"])
    elapsed = [r["elapsed_s"] for r in run.train + run.valid if r.get("elapsed_s") is not None]
    return RunSummary(
        name=run.name, layers=args.get("num_layers"), hidden=args.get("hidden_size"),
        heads=args.get("num_attention_heads"), ffn=args.get("ffn_hidden_size"), seq=args.get("seq_length"),
        experts=moe.get("num_experts"), top_k=top_k_of(moe) if moe else None,
        layout=layout_of(moe) if moe else "-", world_size=run.config.get("world_size"),
        params=count_params(args, moe),
        steps=last["step"], final_train_loss=last["loss"],
        best_valid_loss=min(r["loss"] for r in valid) if valid else None,
        final_valid_loss=valid[-1]["loss"] if valid else None,
        median_tokens_per_s=_median([r.get("tokens_per_s") for r in run.train]),
        median_step_s=_median([r.get("step_s") for r in run.train]),
        final_imbalance=final_log.get("imbalance"), final_dropped_fraction=final_log.get("dropped_fraction"),
        wall_s=max(elapsed) if elapsed else None,
    )
