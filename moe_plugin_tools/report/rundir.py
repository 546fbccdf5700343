"""Read one run directory of the GPT-MoE example: ``run.json`` and ``metrics.jsonl``.

A run directory is what ``examples/gpt_moe/pretrain_gpt_moe.py --run-dir DIR`` writes. Both files
must be there; every non-blank line of ``metrics.jsonl`` must be a JSON object with ``split``,
``step`` and ``loss``. Anything else raises :class:`RunDirError`, whose message names the path
(and the line number), so that the command can print it as one line and exit with status 2.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_KEYS = ("split", "step", "loss")


class RunDirError(ValueError):
    """A directory that is not a run directory, or a run file that cannot be read."""


@dataclass
class Run:
    """One run: its directory, its ``run.json`` and its metric records split by ``split``."""

    path: Path
    config: dict                      # run.json: {"args": {...}, "ds_config": {...}, "world_size": N}
    train: list[dict] = field(default_factory=list)
    valid: list[dict] = field(default_factory=list)
    label: str = ""                   # set when two runs share a directory name

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def args(self) -> dict:
        return self.config.get("args", {})

    @property
    def moe(self) -> dict:
        return self.config.get("ds_config", {}).get("moe", {})

    @property
    def logged(self) -> list[dict]:
        """Training records of log steps: the ones that carry the expert statistics."""
        return [r for r in self.train if "imbalance" in r]


def read_run(path: Path) -> Run:
    """Load ``path``; raise :class:`RunDirError` naming the path if it is not a readable run dir."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    run_json, metrics = path / "run.json", path / "metrics.jsonl"
    missing = [p.name for p in (run_json, metrics) if not p.is_file()]
    if missing:
        raise RunDirError(f"{path}: not a run directory of the GPT-MoE example (no {' or '.join(missing)})")
    try:
        config = json.loads(run_json.read_text())
    except json.JSONDecodeError as err:
        raise RunDirError(f"{run_json}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(config, dict) or not isinstance(config.get("args"), dict):
        raise RunDirError(f"{run_json}: expected an object with an \"args\" object")
    run = Run(path=path, config=config)
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = _parse_line(metrics, number, line)
        (run.valid if record["split"] == "valid" else run.train).append(record)
    if not run.train:
        raise RunDirError(f"{metrics}: no training records")
    return run


def _parse_line(metrics: Path, number: int, line: str) -> dict:
    where = f"{metrics}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise RunDirError(f"{where}: malformed metrics line ({err.msg}): {line[:60]!r}") from None
    if not isinstance(record, dict):
        raise RunDirError(f"{where}: malformed metrics line (expected a JSON object, got {line[:60]!r})")
    missing = [key for key in REQUIRED_KEYS if key not in record]
    if missing:
        raise RunDirError(f"{where}: malformed metrics line (no {', '.join(missing)})")
    if record["split"] not in ("train", "valid"):
        raise RunDirError(f"{where}: malformed metrics line (split {record['split']!r}; expected 'train' "
                          "or 'valid')")
    return record
