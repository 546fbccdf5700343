"""``report.md``: a two-column table per run, and one comparison table (a column per run) for several."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from moe_plugin_tools.report.summary import RunSummary


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _millions(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 1e6:.3f} M ({value:,})"


# (label, how to show it) in table order.
ROWS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("model", lambda s: s.model),
    ("layers", lambda s: _num(s.layers, "d")),
    ("hidden", lambda s: _num(s.hidden, "d")),
    ("heads", lambda s: _num(s.heads, "d")),
    ("ffn", lambda s: _num(s.ffn, "d")),
    ("seq", lambda s: _num(s.seq, "d")),
    ("experts", lambda s: _num(s.experts, "d")),
    ("top-k", lambda s: _num(s.top_k, "d")),
    ("layout", lambda s: s.layout),
    ("world size", lambda s: _num(s.world_size, "d")),
    ("MoE layers", lambda s: "-" if s.params is None else ", ".join(map(str, s.params.moe_layers))),
    ("parameters, total", lambda s: _millions(s.params and s.params.total)),
    ("parameters, active per token", lambda s: _millions(s.params and s.params.active)),
    ("parameters, counted on the model", lambda s: _millions((s.measured_params or {}).get("total"))),
    ("training MFLOPs per token", lambda s: _num(s.params and s.params.flops_per_token / 1e6, ".2f")),
    ("training FLOPs, all steps", lambda s: _num(s.train_flops, ".3e")),
    ("steps", lambda s: str(s.steps)),
    ("final train loss", lambda s: _num(s.final_train_loss, ".4f")),
    ("best validation loss", lambda s: _num(s.best_valid_loss, ".4f")),
    ("final validation loss", lambda s: _num(s.final_valid_loss, ".4f")),
    ("median tokens/s", lambda s: _num(s.median_tokens_per_s, ",.0f")),
    ("median step time (s)", lambda s: _num(s.median_step_s, ".4f")),
    ("peak memory per rank, max (MiB)", lambda s: _num(s.max_peak_memory_mb, ",.0f")),
    ("memory before the model, max (MiB)", lambda s: _num(max(s.memory_before_model_mb)
                                                         if s.memory_before_model_mb else None, ",.0f")),
    ("final expert imbalance", lambda s: _num(s.final_imbalance, ".3f")),
    ("final dropped fraction", lambda s: _num(s.final_dropped_fraction, ".2%")),
    ("wall time (s)", lambda s: _num(s.wall_s, ".1f")),
]

PARAMS_NOTE = ("Parameters are the whole model's by the formula of `moe_plugin_tools/report/params.py` (embeddings "
               "Vh + Ph and output layer Vh; per layer 4h² + 8h attention and norms; 2hf + f + h per dense MLP, "
               "hE + E·m·h·f_e per MoE MLP, m = 3 for swiglu, else 2); active counts the router and the top-k "
               "experts instead of all E; \"counted on the model\" is what the run counted on its ranks. "
               "Training FLOPs per token: 6 x the active weight matrices (output layer included) + 12·L·s·h "
               "for attention scores. Peak memory: the accelerator's peak allocation on GPUs, the process's "
               "peak resident set on CPU (interpreter and libraries included: see the memory before the model).")


def table(summaries: Sequence[RunSummary]) -> str:
    """A markdown table: one row per quantity, one column per run."""
    lines = ["| | " + " | ".join(s.name for s in summaries) + " |",
             "|---|" + "---:|" * len(summaries)]
    lines += [f"| {label} | " + " | ".join(show(s) for s in summaries) + " |" for label, show in ROWS]
    return "\n".join(lines)


def render(summaries: Sequence[RunSummary], plots: Sequence[str]) -> str:
    parts = ["# Run report", ""]
    if len(summaries) > 1:
        parts += ["## Comparison", "", table(summaries), ""]
    for summary in summaries:
        parts += [f"## {summary.name}", "", table([summary]), ""]
    parts += [PARAMS_NOTE, ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{name}]({name})" for name in plots] + [""]
    return "\n".join(parts)
