"""``write_report``: read the run dirs, write ``report.md`` and the PNGs into one directory."""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from moe_plugin_tools.report import markdown, plots
from moe_plugin_tools.report.rundir import Run, read_run
from moe_plugin_tools.report.summary import RunSummary, as_record, summarize


def _label_duplicates(runs: Sequence[Run]) -> None:
    """Two runs named alike (a/run, b/run) are told apart by their parent directory, a repeat by a number."""
    counts = Counter(run.path.name for run in runs)
    for run in runs:
        if counts[run.path.name] > 1:
            run.label = f"{run.path.resolve().parent.name}/{run.path.name}"
    seen: Counter = Counter()
    for run in runs:                  # the same directory given twice
        seen[run.name] += 1
        if seen[run.name] > 1:
            run.label = f"{run.name} ({seen[run.name]})"


def write_report(run_dirs: Sequence[Path], out: Optional[Path] = None) -> list[Path]:
    """Write the report of ``run_dirs`` into ``out`` (default: the first run dir); return the files.

    Every run dir is read before anything is written, so a bad one leaves no half report.
    """
    if not run_dirs:
        raise ValueError("no run directory given")
    runs = [read_run(Path(d)) for d in run_dirs]
    _label_duplicates(runs)
    out = Path(out) if out is not None else runs[0].path
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(run) for run in runs]
    written = [plots.plot_loss(runs, out), plots.plot_loss_vs_flops(runs, summaries, out),
               plots.plot_scaling(summaries, out), plots.plot_balance(runs, out)]
    written += [plots.plot_expert_load(run, out) for run in runs]
    written = [p for p in written if p is not None]
    report = out / "report.md"
    report.write_text(markdown.render(summaries, [p.name for p in written]))
    return [report, *write_tables(runs, summaries, out), *written]


def curves(run: Run) -> dict:
    """The run's curves over steps, as [step, value] pairs: validation loss; expert imbalance and
    dropped fraction at the log steps (empty for a dense run)."""
    valid = sorted(run.valid, key=lambda r: r["step"])
    logged = sorted(run.logged, key=lambda r: r["step"])
    return {"valid_loss_by_step": [[r["step"], r["loss"]] for r in valid],
            "imbalance_by_step": [[r["step"], r["imbalance"]] for r in logged],
            "dropped_fraction_by_step": [[r["step"], r.get("dropped_fraction")] for r in logged]}


def write_tables(runs: Sequence[Run], summaries: Sequence[RunSummary], out: Path) -> list[Path]:
    """``summary.csv`` (a row of numbers per run) and ``summary.json`` (the same rows in a list,
    each with the run's curves over steps)."""
    records = [as_record(s) for s in summaries]
    csv_path, json_path = out / "summary.csv", out / "summary.json"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        for record in records:
            writer.writerow({key: " ".join(map(str, value)) if isinstance(value, list) else value
                             for key, value in record.items()})
    json_path.write_text(json.dumps({"runs": [{**r, **curves(run)} for r, run in zip(records, runs)]}, indent=2)
                         + "\n")
    return [csv_path, json_path]
