"""The report's PNGs (matplotlib, Agg backend): losses, expert balance, expert load heat maps.

``loss.png``       training and validation loss vs step, one line per run
``loss_vs_flops.png``  validation (and smoothed training) loss vs training FLOPs, one line per run
``scaling.png``    parameters (total, active) and step time vs number of experts (dense as a reference line)
``balance.png``    expert imbalance (max / mean tokens, mean over the MoE layers) and dropped fraction at the log steps
``expert_load_<run>.png``  tokens per expert over the log steps, one panel per MoE layer
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from moe_plugin_tools.report.rundir import Run
from moe_plugin_tools.report.summary import RunSummary


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("moe-plugin report draws with matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def clip_first_drop(ax, curves: Sequence[Sequence[float]]) -> None:
    """Upper y limit at the curves' highest value after their first tenth, so that the first
    steps' drop from ~ln(vocabulary) does not flatten the part where the runs differ."""
    tails = [v for c in curves for v in c[len(c) // 10:]]
    heads = [v for c in curves for v in c]
    if tails and heads and max(heads) > 1.5 * max(tails):
        ax.set_ylim(min(tails) - 0.05 * (max(tails) - min(tails)), max(tails) * 1.05)


def plot_loss(runs: Sequence[Run], out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        ax_train.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], label=run.name, lw=1)
    clip_first_drop(ax_train, [[r["loss"] for r in run.train] for run in runs])
    for run in runs:
        if run.valid:
            ax_valid.plot([r["step"] for r in run.valid], [r["loss"] for r in run.valid], "o-", label=run.name)
    for ax, title in ((ax_train, "training loss (global batch)"), (ax_valid, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("cross entropy (nats / token)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    return _save(fig, plt, out / "loss.png")


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, value in enumerate(values):
        acc += value
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_loss_vs_flops(runs: Sequence[Run], summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """Loss against training FLOPs (formula FLOPs per token x tokens), one line per run; None when
    no run has its FLOPs (an older run.json without the vocabulary)."""
    pairs = [(run, s) for run, s in zip(runs, summaries) if s.params is not None and s.tokens_per_step]
    if not pairs:
        return None
    plt = _pyplot()
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves = []
    for run, summary in pairs:
        per_step = summary.params.flops_per_token * summary.tokens_per_step
        train = sorted(run.train, key=lambda r: r["step"])
        window = max(1, len(train) // 40)
        curves.append(smoothed([r["loss"] for r in train], window))
        ax_train.plot([r["step"] * per_step for r in train], curves[-1], lw=1, label=summary.model)
        if run.valid:
            valid = sorted(run.valid, key=lambda r: r["step"])
            ax_valid.plot([r["step"] * per_step for r in valid], [r["loss"] for r in valid], "o-", ms=3,
                          label=summary.model)
    clip_first_drop(ax_train, curves)
    for ax, title in ((ax_train, "training loss (trailing mean)"), (ax_valid, "validation loss")):
        ax.set_title(f"{title} vs training compute")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("cross entropy (nats / token)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, plt, out / "loss_vs_flops.png")


def plot_scaling(summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """Total / active parameters, median step time and best validation loss against the number of
    experts, a line per top-k; the dense runs as dashed reference lines. None when no run has experts."""
    moe = [s for s in summaries if s.experts]
    if not moe:
        return None
    plt = _pyplot()
    fig, (ax_params, ax_time, ax_loss) = plt.subplots(1, 3, figsize=(16, 4.5))
    for k in sorted({s.top_k for s in moe}):
        series = sorted((s for s in moe if s.top_k == k), key=lambda s: s.experts)
        experts = [s.experts for s in series]
        if all(s.params for s in series):
            ax_params.plot(experts, [s.params.total / 1e6 for s in series], "o-", label=f"top-{k}, total")
            ax_params.plot(experts, [s.params.active / 1e6 for s in series], "s:", label=f"top-{k}, active per token")
        if all(s.median_step_s for s in series):
            ax_time.plot(experts, [1e3 * s.median_step_s for s in series], "o-", label=f"top-{k}")
        if all(s.best_valid_loss is not None for s in series):
            ax_loss.plot(experts, [s.best_valid_loss for s in series], "o-", label=f"top-{k}")
    for dense in (s for s in summaries if s.model == "dense"):
        label = dense.name if dense.name == "dense" else f"{dense.name} (dense)"
        if dense.params:
            ax_params.axhline(dense.params.total / 1e6, color="gray", ls="--", lw=1, label=label)
        if dense.median_step_s:
            ax_time.axhline(1e3 * dense.median_step_s, color="gray", ls="--", lw=1, label=label)
        if dense.best_valid_loss is not None:
            ax_loss.axhline(dense.best_valid_loss, color="gray", ls="--", lw=1, label=label)
    ax_params.set_title("parameters")
    ax_params.set_ylabel("millions")
    ax_time.set_title("median step time")
    ax_time.set_ylabel("ms")
    ax_time.set_ylim(bottom=0)
    ax_loss.set_title("best validation loss (same steps and tokens)")
    ax_loss.set_ylabel("cross entropy (nats / token)")
    for ax in (ax_params, ax_time, ax_loss):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per MoE layer")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, plt, out / "scaling.png")


def plot_balance(runs: Sequence[Run], out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_imb, ax_drop) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps = [r["step"] for r in run.logged]
        ax_imb.plot(steps, [r["imbalance"] for r in run.logged], "o-", ms=3, label=run.name)
        ax_drop.plot(steps, [100 * r.get("dropped_fraction", 0.0) for r in run.logged], "o-", ms=3, label=run.name)
    ax_imb.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax_imb.set_title("expert imbalance (max / mean tokens, mean over MoE layers)")
    ax_drop.set_title("dropped routes (%)")
    for ax in (ax_imb, ax_drop):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    return _save(fig, plt, out / "balance.png")


def expert_load(run: Run) -> dict[int, tuple[list[int], list[list[int]]]]:
    """Per MoE layer: the log steps and, for each, the tokens routed to each expert."""
    layers: dict[int, tuple[list[int], list[list[int]]]] = {}
    for record in run.logged:
        for entry in record.get("moe_layers", []):
            steps, loads = layers.setdefault(entry["layer"], ([], []))
            steps.append(record["step"])
            loads.append(entry["tokens_per_expert"])
    return layers


def plot_expert_load(run: Run, out: Path) -> Path | None:
    """Heat map of tokens per expert (rows) over log steps (columns); None if no layer logged any."""
    layers = expert_load(run)
    if not layers:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(layers), 1, figsize=(10, 2.2 + 1.8 * len(layers)), squeeze=False)
    for ax, (layer, (steps, loads)) in zip(axes[:, 0], sorted(layers.items())):
        columns = list(zip(*loads))                   # [expert][log step]
        image = ax.imshow(columns, aspect="auto", cmap="viridis", interpolation="nearest",
                          extent=(-0.5, len(steps) - 0.5, len(columns) - 0.5, -0.5))
        ticks = range(0, len(steps), max(1, len(steps) // 10))
        ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks])
        ax.set_ylabel("expert")
        ax.set_title(f"{run.name}: MoE layer {layer}, tokens per expert")
        fig.colorbar(image, ax=ax, label="tokens")
    axes[-1, 0].set_xlabel("step")
    return _save(fig, plt, out / f"expert_load_{safe_name(run.name)}.png")


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
