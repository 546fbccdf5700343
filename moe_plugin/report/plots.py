"""The report's PNGs (matplotlib, Agg backend): losses, expert balance, expert load heat maps.

``loss.png``       training and validation loss vs step, one line per run
``balance.png``    expert imbalance (max / mean tokens, mean over the MoE layers) and dropped fraction at the log steps
``expert_load_<run>.png``  tokens per expert over the log steps, one panel per MoE layer
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from moe_plugin.report.rundir import Run


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("moe-plugin report draws with matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_loss(runs: Sequence[Run], out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        ax_train.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], label=run.name, lw=1)
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
