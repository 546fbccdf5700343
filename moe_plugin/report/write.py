"""``write_report``: read the run dirs, write ``report.md`` and the PNGs into one directory."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from moe_plugin.report import markdown, plots
from moe_plugin.report.rundir import Run, read_run
from moe_plugin.report.summary import summarize


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
    written = [plots.plot_loss(runs, out), plots.plot_balance(runs, out)]
    written += [p for p in (plots.plot_expert_load(run, out) for run in runs) if p is not None]
    report = out / "report.md"
    report.write_text(markdown.render([summarize(run) for run in runs], [p.name for p in written]))
    return [report] + written
