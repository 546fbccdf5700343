"""The example's record of a run: console lines, ``metrics.jsonl`` and a PNG plot (rank 0 only).

    log = TrainingLog(run_dir, enabled=(rank == 0))
    log.train(step=9, loss=3.2, lr=3e-4, skipped_steps=0)       # every step: one JSON line
    log.train(step=10, loss=3.1, lr=3e-4, report={"tokens_per_s": 1200.0, "epoch": 0.1, **moe})  # + console
    log.valid(step=50, loss=3.4)
    png = log.plot()                     # runs/<name>/metrics.png: loss and expert imbalance

Every record is one JSON object per line in ``metrics.jsonl`` (``"split"``: ``"train"`` or
``"valid"``), so other tools (a scaling study, a notebook) read it with ``json.loads`` per
line. The run directory is created on the first record, not before: a run that stops on a
bad flag leaves nothing behind.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional


class TrainingLog:
    def __init__(self, run_dir: Path, enabled: bool = True, append: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.plot_path = self.run_dir / "metrics.png"
        self._mode = "a" if append else "w"
        self._start = time.monotonic()
        self._losses: list[float] = []

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, self._mode) as f:
            f.write(json.dumps(record) + "\n")
        self._mode = "a"

    def info(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def train(self, step: int, loss: float, lr: float, report: Optional[dict] = None,
              step_s: Optional[float] = None, skipped_steps: Optional[int] = None) -> None:
        """Record one training step (its global-batch loss; ``step_s``: its wall time;
        ``skipped_steps``: steps the engine skipped for overflow so far, in the record and the line). With
        ``report`` (the log interval's ``tokens_per_s``, ``epoch``, MoE statistics and, with
        dynamic placement, a ``placement`` summary) also print one line, whose loss is the mean
        over the steps since the previous line."""
        self._losses.append(loss)
        record = {"split": "train", "step": step, "loss": loss, "lr": lr,
                  "elapsed_s": round(time.monotonic() - self._start, 3), **(report or {})}
        if step_s is not None:
            record["step_s"] = round(step_s, 5)
        if skipped_steps is not None:
            record["skipped_steps"] = skipped_steps
        self.write(record)
        if report is None:
            return
        mean = sum(self._losses) / len(self._losses)
        self._losses.clear()
        text = (f"step {step:6d} | loss {mean:.4f} | lr {lr:.2e} | {report['tokens_per_s']:7.0f} tokens/s"
                f" | epoch {report['epoch']:.2f}")
        if "moe" in report:
            text += f" | {report['moe']}"
        if "placement" in report:
            text += f" | {report['placement']}"
        if skipped_steps is not None:
            text += f" | skipped {skipped_steps}"
        self.info(text)

    def valid(self, step: int, loss: float) -> None:
        self.write({"split": "valid", "step": step, "loss": loss,
                    "elapsed_s": round(time.monotonic() - self._start, 3)})
        self.info(f"step {step:6d} | validation loss {loss:.6f}")

    def plot(self) -> Optional[Path]:
        """Training and validation loss, and expert imbalance / dropped fraction, over steps."""
        if not self.enabled or not self.metrics_path.exists():
            return None
        try:
            import matplotlib
        except ImportError:
            print("note: matplotlib is not installed, no plot (pip install matplotlib)", file=sys.stderr)
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        train = [r for r in records if r["split"] == "train"]
        valid = [r for r in records if r["split"] == "valid"]
        fig, (ax_loss, ax_moe) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="training (global batch)")
        if valid:
            ax_loss.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="validation")
        ax_loss.set_ylabel("cross entropy (nats / token)")
        ax_loss.set_title(self.run_dir.name)
        ax_loss.legend()
        ax_loss.grid(alpha=0.3)
        moe = [r for r in train if "imbalance" in r]
        if moe:
            steps = [r["step"] for r in moe]
            ax_moe.plot(steps, [r["imbalance"] for r in moe], color="tab:red", label="imbalance (max / mean tokens)")
            ax_moe.axhline(1.0, color="gray", lw=0.8, ls=":")
            ax_moe.set_ylabel("expert imbalance", color="tab:red")
            ax_drop = ax_moe.twinx()
            ax_drop.plot(steps, [100 * r["dropped_fraction"] for r in moe], color="tab:green", label="dropped")
            ax_drop.set_ylabel("dropped routes (%)", color="tab:green")
        ax_moe.set_xlabel("step")
        ax_moe.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
        return self.plot_path
