"""One run reduced to the numbers of its report row: model flags, parameters, losses, speed, balance."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from moe_plugin_tools.report.params import ParamCount, count_params, top_k_of
from moe_plugin_tools.report.rundir import Run


@dataclass(frozen=True)
class RunSummary:
    """The row of one run. A value the run did not record is None (shown as "-")."""

    name: str
    model: str                        # "dense", or "8 experts top-2"
    layers: Optional[int]
    hidden: Optional[int]
    heads: Optional[int]
    ffn: Optional[int]
    seq: Optional[int]
    experts: Optional[int]
    top_k: Optional[int]
    layout: str                       # "tp1 pp1 ep2 etp1" from the "moe" block's parallel sizes
    world_size: Optional[int]
    params: Optional[ParamCount]      # the formula (report/params.py)
    measured_params: Optional[dict]   # run.json "parameters": counted on the model by the example
    tokens_per_step: Optional[int]    # global batch x sequence length
    steps: int                        # last training step
    final_train_loss: float
    best_valid_loss: Optional[float]
    final_valid_loss: Optional[float]
    median_tokens_per_s: Optional[float]
    median_step_s: Optional[float]
    final_imbalance: Optional[float]
    final_dropped_fraction: Optional[float]
    wall_s: Optional[float]           # largest elapsed_s of any record
    peak_memory_mb: Optional[list]    # per rank, at the last log step (GPU: peak allocated; CPU: peak RSS)
    memory_before_model_mb: Optional[list]   # per rank, peak RSS before the model was built

    @property
    def train_flops(self) -> Optional[float]:
        """Training FLOPs of all ``steps`` (formula FLOPs per token x tokens)."""
        if self.params is None or self.tokens_per_step is None:
            return None
        return float(self.params.flops_per_token) * self.tokens_per_step * self.steps

    @property
    def max_peak_memory_mb(self) -> Optional[float]:
        return max(self.peak_memory_mb) if self.peak_memory_mb else None


def layout_of(moe: dict, experts: bool = True) -> str:
    """``tp1 pp1 ep2 etp1`` from the "moe" block's parallel sizes (``tp1 pp1`` for a dense model)."""
    parallel = moe.get("parallel", {})
    tp = parallel.get("tensor", 1)
    etp = parallel.get("expert_tensor") or tp
    dense = f"tp{tp} pp{parallel.get('pipeline', 1)}"
    return f"{dense} ep{parallel.get('expert', 1)} etp{etp}" if experts else dense


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def model_name(args: dict, moe: dict) -> str:
    if args.get("dense") or not moe:
        return "dense"
    return f"{moe.get('num_experts')} experts top-{top_k_of(moe)}"


def tokens_per_step(run: Run) -> Optional[int]:
    batch, seq = run.config.get("ds_config", {}).get("train_batch_size"), run.args.get("seq_length")
    return batch * seq if batch and seq else None


def summarize(run: Run) -> RunSummary:
    args, moe = run.args, run.moe
    last = max(run.train, key=lambda r: r["step"])
    logged = run.logged
    final_log = max(logged, key=lambda r: r["step"]) if logged else {}
    valid = sorted(run.valid, key=lambda r: r["step"])
    elapsed = [r["elapsed_s"] for r in run.train + run.valid if r.get("elapsed_s") is not None]
    model = model_name(args, moe)
    moe_on = model != "dense"
    return RunSummary(
        name=run.name, model=model, layers=args.get("num_layers"), hidden=args.get("hidden_size"),
        heads=args.get("num_attention_heads"), ffn=args.get("ffn_hidden_size"), seq=args.get("seq_length"),
        experts=moe.get("num_experts") if moe_on else None, top_k=top_k_of(moe) if moe_on else None,
        layout=layout_of(moe, experts=moe_on) if moe else "-", world_size=run.config.get("world_size"),
        params=count_params(args, moe, run.config.get("vocab_size")), measured_params=run.config.get("parameters"),
        tokens_per_step=tokens_per_step(run),
        steps=last["step"], final_train_loss=last["loss"],
        best_valid_loss=min(r["loss"] for r in valid) if valid else None,
        final_valid_loss=valid[-1]["loss"] if valid else None,
        median_tokens_per_s=_median([r.get("tokens_per_s") for r in run.train]),
        median_step_s=_median([r.get("step_s") for r in run.train]),
        final_imbalance=final_log.get("imbalance"), final_dropped_fraction=final_log.get("dropped_fraction"),
        wall_s=max(elapsed) if elapsed else None,
        peak_memory_mb=next((r["peak_memory_mb"] for r in reversed(run.train) if r.get("peak_memory_mb")), None),
        memory_before_model_mb=run.config.get("memory_before_model_mb"),
    )


def as_record(summary: RunSummary) -> dict:
    """The summary as one flat row of plain values (the CSV columns and the JSON summary's entries)."""
    params, measured = summary.params, summary.measured_params or {}
    return {
        "name": summary.name, "model": summary.model, "experts": summary.experts, "top_k": summary.top_k,
        "layers": summary.layers, "hidden": summary.hidden, "ffn": summary.ffn, "seq": summary.seq,
        "layout": summary.layout, "world_size": summary.world_size,
        "params_total": params and params.total, "params_active": params and params.active,
        "params_expert": params and params.expert,
        "measured_params_total": measured.get("total"), "measured_params_active": measured.get("active"),
        "flops_per_token": params and params.flops_per_token, "tokens_per_step": summary.tokens_per_step,
        "steps": summary.steps, "train_flops": summary.train_flops,
        "final_train_loss": summary.final_train_loss, "best_valid_loss": summary.best_valid_loss,
        "final_valid_loss": summary.final_valid_loss, "median_step_s": summary.median_step_s,
        "median_tokens_per_s": summary.median_tokens_per_s, "peak_memory_mb_max": summary.max_peak_memory_mb,
        "peak_memory_mb_per_rank": summary.peak_memory_mb,
        "memory_before_model_mb_per_rank": summary.memory_before_model_mb,
        "final_imbalance": summary.final_imbalance, "final_dropped_fraction": summary.final_dropped_fraction,
        "wall_s": summary.wall_s,
    }
