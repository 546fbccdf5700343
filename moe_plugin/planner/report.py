"""What ``moe-plugin plan`` writes: ``candidate_<i>_<layout>.json`` (a launch-ready DeepSpeed JSON per pool
member), ``pool.json`` (the predictions), ``plan.md`` (the ranked table) and ``plan.png`` (step time vs memory).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from moe_plugin.planner.cost_model import tokens_per_step
from moe_plugin.planner.search import Candidate, ds_config
from moe_plugin.planner.spec import ClusterSpec, PlanModel

COLUMNS = ("rank", "layout", "tp", "pp", "ep", "etp", "dp", "zero", "mb x gas", "step ms", "compute", "experts",
           "dispatch", "a2a", "tp comm", "dp comm", "bubble", "mem GB", "tokens/s")


def table_rows(candidates: Sequence[Candidate], model: PlanModel) -> list[list[str]]:
    rows = []
    for i, c in enumerate(candidates, 1):
        lay, cost = c.layout, c.cost
        rows.append([str(i), lay.name(), str(lay.tp), str(lay.pp), str(lay.ep), str(lay.etp), str(lay.dp),
                     str(lay.zero), f"{lay.micro_batch} x {lay.gas}", f"{1e3 * c.time:.1f}",
                     f"{1e3 * cost.compute:.1f}", f"{1e3 * cost.experts:.1f}", f"{1e3 * cost.dispatch:.1f}",
                     f"{1e3 * cost.all_to_all:.1f}",
                     f"{1e3 * cost.tp_comm:.1f}", f"{1e3 * cost.dp_comm:.1f}", f"{1e3 * cost.bubble:.1f}",
                     f"{cost.memory_total / 1e9:.2f}", f"{tokens_per_step(model) / c.time:,.0f}"])
    return rows


def text_table(header: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))   # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(header: Sequence[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def write_pool(out: Path, pool: Sequence[Candidate], model: PlanModel,
               placements: Optional[Sequence[dict]] = None, replays: Optional[Sequence[dict]] = None) -> list[Path]:
    """One DeepSpeed JSON per pool member (with its placement block) and ``pool.json``; returns the JSONs' paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths, entries = [], []
    for i, c in enumerate(pool, 1):
        placement = placements[i - 1] if placements is not None else None
        path = out / f"candidate_{i}_{c.layout.name().replace('/', '_')}.json"
        path.write_text(json.dumps(ds_config(model, c.layout, placement), indent=2) + "\n")
        paths.append(path)
        entries.append({"rank": i, "config": path.name, "layout": vars(c.layout).copy(),
                        "predicted_s": c.cost.as_dict(), "placement": placement})
        if replays is not None:
            entries[-1]["replay"] = replays[i - 1]
    (out / "pool.json").write_text(json.dumps(entries, indent=2) + "\n")
    return paths


def write_markdown(out: Path, model: PlanModel, cluster: ClusterSpec, candidates: Sequence[Candidate],
                   pool: Sequence[Candidate], extra: str = "", shown: int = 20) -> Path:
    fitting = [c for c in candidates if c.fits]
    ranked = list(pool) + [c for c in fitting if c not in pool][:max(0, shown - len(pool))]
    text = [f"# Plan: {model.total_params() / 1e6:,.0f}M-parameter GPT-MoE ({model.moe.num_experts} experts, "
            f"top-{model.moe.k}) on {cluster.name} ({cluster.world_size} ranks)", "",
            f"{len(candidates)} valid layouts, {len(fitting)} fit in {cluster.memory_usable:.0%} of "
            f"{cluster.memory / 1e9:.0f} GB; the pool is rows 1-{len(pool)} (one per parallel shape). "
            "Times in ms per optimizer step (predicted), memory per rank.", "",
            markdown_table(COLUMNS, table_rows(ranked, model)), ""]
    if extra:
        text += [extra, ""]
    text += ["![predicted step time vs memory](plan.png)", ""]
    path = out / "plan.md"
    path.write_text("\n".join(text))
    return path


def plot(out: Path, candidates: Sequence[Candidate], pool: Sequence[Candidate], cluster: ClusterSpec,
         title: Optional[str] = None) -> Path:
    """Scatter of predicted step time vs memory per rank; pool members circled and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    fit = [c for c in candidates if c.fits]
    over = [c for c in candidates if not c.fits]
    ax.scatter([c.cost.memory_total / 1e9 for c in fit], [1e3 * c.time for c in fit], s=10, c="tab:blue",
               alpha=0.5, label=f"fits ({len(fit)})")
    if over:
        ax.scatter([c.cost.memory_total / 1e9 for c in over], [1e3 * c.time for c in over], s=10, c="0.6",
                   marker="x", alpha=0.5, label=f"does not fit ({len(over)})")
    ax.scatter([c.cost.memory_total / 1e9 for c in pool], [1e3 * c.time for c in pool], s=80,
               facecolors="none", edgecolors="tab:red", linewidths=1.5, label=f"pool ({len(pool)})")
    for i, c in enumerate(pool, 1):   # numbers fanned out (pool members often sit together), names in a box
        ax.annotate(str(i), (c.cost.memory_total / 1e9, 1e3 * c.time), fontsize=8, color="tab:red",
                    xytext=(12 + 10 * (i - 1), -14 - 9 * (i - 1)), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", color="tab:red", lw=0.5))
    ax.text(0.99, 0.99, "\n".join(f"{i}: {c.layout.name()}  {1e3 * c.time:.1f} ms" for i, c in enumerate(pool, 1)),
            transform=ax.transAxes, ha="right", va="top", fontsize=7, family="monospace",
            bbox=dict(facecolor="white", edgecolor="tab:red", alpha=0.9))
    ax.axvline(cluster.memory * cluster.memory_usable / 1e9, color="tab:red", ls="--", lw=1,
               label="usable memory")
    ax.set_xlabel("memory per rank (GB, predicted)")
    ax.set_ylabel("step time (ms, predicted)")
    ax.set_yscale("log")
    ax.set_title(title or f"Layouts on {cluster.name}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "plan.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
