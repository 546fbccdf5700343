"""The GPT-MoE scaling study: dense vs MoE (4 to 32 experts, top-2 and top-1) at the same compute.

    python examples/gpt_moe/scaling/study.py            # the nine models, ~40 minutes on 4 CPU ranks
    python examples/gpt_moe/scaling/study.py --quick    # the same nine, tiny, ~3 minutes (CI)
    python examples/gpt_moe/scaling/study.py --models dense,e8-top2 --ranks 2

Every model is trained by ``pretrain_gpt_moe.py`` through the ``deepspeed`` launcher on
``--ranks`` ranks, one after another, into ``OUT/runs/<model>`` (its log: ``OUT/logs/<model>.log``).
A model already trained with the same sizes is not trained again, so a stopped study resumes
where it stopped (``--fresh``: train everything again). At the end ``moe-plugin report`` writes
``OUT/report.md``, ``OUT/summary.csv``, ``OUT/summary.json`` and the plots, and the study adds
``OUT/study.json`` (what ran, on what, how long) and prints the comparison with the dense model.
The models are in ``family.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SCRIPT = HERE.parent / "pretrain_gpt_moe.py"
sys.path.insert(0, str(HERE))
from family import SIZES, Model, Sizes, by_name, ds_config, family, model_flags  # noqa: E402

FINGERPRINT = "study_model.json"   # in a run dir once its model trained to the end


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps: checks the machinery (CI)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per model (deepspeed --num_gpus)")
    parser.add_argument("--models", default=None, help="comma-separated subset, e.g. dense,e8-top2 (default: all)")
    parser.add_argument("--train-iters", type=int, default=None, help="override the sizes' steps per model")
    parser.add_argument("--out", default=None, help="study directory (default: runs/scaling or runs/scaling_quick)")
    parser.add_argument("--data-cache", default=str(ROOT / "data"), help="where the stdlib corpus is written once")
    parser.add_argument("--fresh", action="store_true", help="train every model again, even if already trained")
    parser.add_argument("--master-port", type=int, default=29611, help="the launcher's rendezvous port")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks: got {args.ranks}; expected an integer >= 1")
    if args.train_iters is not None and args.train_iters < 1:
        parser.error(f"--train-iters: got {args.train_iters}; expected an integer >= 1")
    return args


@dataclasses.dataclass
class Study:
    sizes: Sizes
    models: list[Model]
    ranks: int
    out: Path
    data_cache: str
    master_port: int

    def run_dir(self, model: Model) -> Path:
        return self.out / "runs" / model.name

    def fingerprint(self, model: Model) -> dict:
        return {"model": dataclasses.asdict(model), "sizes": dataclasses.asdict(self.sizes), "ranks": self.ranks}

    def trained(self, model: Model) -> bool:
        """Whether ``model`` already trained to the end with these sizes on this many ranks."""
        path = self.run_dir(model) / FINGERPRINT
        try:
            return json.loads(path.read_text()) == json.loads(json.dumps(self.fingerprint(model)))
        except (OSError, json.JSONDecodeError):
            return False

    def config(self, model: Model) -> dict:
        """``model``'s DeepSpeed JSON."""
        return ds_config(model, self.sizes, self.ranks)

    def command(self, model: Model) -> list[str]:
        config = self.out / "configs" / f"{model.name}.json"
        return [launcher(), "--num_gpus", str(self.ranks), "--master_port", str(self.master_port), str(SCRIPT),
                "--deepspeed_config", str(config), *model_flags(model, self.sizes),
                "--run-dir", str(self.run_dir(model)), "--data-cache", self.data_cache]


def launcher() -> str:
    """The ``deepspeed`` launcher next to this interpreter (a venv's), else the first on PATH."""
    local = Path(sys.executable).parent / "deepspeed"
    found = str(local) if local.exists() else shutil.which("deepspeed")
    if found is None:
        raise SystemExit("error: the deepspeed launcher is not installed (pip install deepspeed, or run `make install`)")
    return found


def progress_line(index: int, study: Study, model: Model, started: float, study_started: float,
                  durations: list[float]) -> str:
    """``[3/9] e8-top2 | step 400/1000 | loss 2.31 | valid 2.40 | 1m12s | study 9m30s, ~14m left``."""
    metrics = study.run_dir(model) / "metrics.jsonl"
    step, loss, valid = 0, None, None
    try:
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("split") == "train":
                step, loss = record["step"], record["loss"]
            elif record.get("split") == "valid":
                valid = record["loss"]
    except (OSError, json.JSONDecodeError, KeyError):
        pass   # not written yet, or a line being written
    now = time.monotonic()
    total = getattr(model, "steps", 0) or study.sizes.train_iters   # a model trained for other steps says so
    text = f"[{index}/{len(study.models)}] {model.name:9s} | step {step}/{total}"
    if loss is not None:
        text += f" | loss {loss:.3f}"
    if valid is not None:
        text += f" | valid {valid:.3f}"
    text += f" | {clock(now - started)} | study {clock(now - study_started)}"
    if durations:   # this model's rest and the models after it, at the mean of those trained so far
        mean = sum(durations) / len(durations)
        text += f", ~{clock(max(0.0, mean - (now - started)) + (len(study.models) - index) * mean)} left"
    return text


def clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def train(study: Study, index: int, model: Model, study_started: float, durations: list[float]) -> float:
    """Train ``model`` through the launcher, showing progress; returns its wall time. A failed
    run exits the study with the end of its log (the models trained before it are kept)."""
    run_dir, log_path = study.run_dir(model), study.out / "logs" / f"{model.name}.log"
    if run_dir.exists():
        shutil.rmtree(run_dir)   # an unfinished earlier attempt
    log_path.parent.mkdir(parents=True, exist_ok=True)
    config = study.out / "configs" / f"{model.name}.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(study.config(model), indent=2) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    tty = sys.stdout.isatty()
    with open(log_path, "w") as log:
        process = subprocess.Popen(study.command(model), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        last, printed = "", time.monotonic()
        while process.poll() is None:
            time.sleep(1.0)
            if tty:   # one line, rewritten in place
                line = progress_line(index, study, model, started, study_started, durations)
                print("\r" + line.ljust(len(last)), end="", flush=True)
                last = line
            elif time.monotonic() - printed >= 30:   # a log file: a line every 30 s
                print(progress_line(index, study, model, started, study_started, durations), flush=True)
                printed = time.monotonic()
    seconds = time.monotonic() - started
    print(("\r" if tty else "") + progress_line(index, study, model, started, study_started, durations)
          + (" | done" if process.returncode == 0 else " | FAILED"), flush=True)
    if process.returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        print("\n".join(lines[-12:]), file=sys.stderr)
        cause = next((line for line in lines if line.startswith("error:") or "Error:" in line), "")
        raise SystemExit(f"error: {model.name} failed (exit status {process.returncode})"
                         + (f": {cause.removeprefix('error: ')}" if cause else "") + f"; full log: {log_path}. "
                         "Models trained before it are kept; run the study again to resume.")
    (run_dir / FINGERPRINT).write_text(json.dumps(study.fingerprint(model), indent=2) + "\n")
    return seconds


def machine() -> dict:
    import deepspeed
    import torch

    return {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "accelerator": "cuda" if torch.cuda.is_available() else "cpu"}


def compare(records: list[dict]) -> list[str]:
    """One line per model against the dense one: parameters, step time, best validation loss."""
    dense = next((r for r in records if r["model"] == "dense"), None)   # the report's model kind
    lines = [f"{'model':16s} {'params':>9s} {'active':>9s} {'x params':>8s} {'step ms':>8s} {'x time':>7s} "
             f"{'best valid':>10s} {'vs dense':>9s}"]
    for r in records:
        ratio = (lambda key: r[key] / dense[key] if dense and dense.get(key) and r.get(key) else float("nan"))
        gain = (r["best_valid_loss"] - dense["best_valid_loss"]
                if dense and r.get("best_valid_loss") is not None and dense.get("best_valid_loss") is not None
                else float("nan"))
        step_ms = 1e3 * r["median_step_s"] if r.get("median_step_s") else float("nan")
        valid = r["best_valid_loss"] if r.get("best_valid_loss") is not None else float("nan")
        lines.append(f"{r['name']:16s} {fmt_m(r['params_total']):>9s} {fmt_m(r['params_active']):>9s} "
                     f"{ratio('params_total'):8.2f} {step_ms:8.1f} {ratio('median_step_s'):7.2f} "
                     f"{valid:10.4f} {gain:+9.4f}")
    return lines


def fmt_m(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}M"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    if args.train_iters is not None:
        sizes = dataclasses.replace(sizes, train_iters=args.train_iters,
                                    eval_interval=min(sizes.eval_interval, args.train_iters))
    try:
        models = by_name(sizes, args.models.split(",")) if args.models else family(sizes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    experts = [m.experts for m in models if not m.dense]
    if any(e % min(args.ranks, e) for e in experts):
        print(f"error: --ranks: got {args.ranks}; must divide the number of experts of every model "
              f"({', '.join(map(str, sorted(set(experts))))}) or be larger", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "runs" / ("scaling_quick" if args.quick else "scaling")).resolve()
    study = Study(sizes, models, args.ranks, out, args.data_cache, args.master_port)
    out.mkdir(parents=True, exist_ok=True)
    print(f"scaling study: {len(models)} models, {sizes.train_iters} steps of {sizes.micro_batch_size * args.ranks} x "
          f"{sizes.seq_length} tokens each, {args.ranks} ranks -> {out}", flush=True)
    study_started, durations, wall = time.monotonic(), [], {}
    for index, model in enumerate(models, start=1):
        if study.trained(model) and not args.fresh:
            print(f"[{index}/{len(models)}] {model.name:9s} | already trained ({study.run_dir(model)})", flush=True)
            continue
        wall[model.name] = train(study, index, model, study_started, durations)
        durations.append(wall[model.name])

    from moe_plugin_tools.report import write_report

    written = write_report([study.run_dir(m) for m in models], out)
    records = json.loads((out / "summary.json").read_text())["runs"]
    (out / "study.json").write_text(json.dumps({
        "sizes": dataclasses.asdict(sizes), "ranks": args.ranks, "models": [m.name for m in models],
        "machine": machine(), "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s_this_invocation": round(time.monotonic() - study_started, 1),
        "wall_s_per_model_this_invocation": {k: round(v, 1) for k, v in wall.items()},
        "launch": " ".join(study.command(models[0])[:4]) + " ...",
    }, indent=2) + "\n")
    print("\n".join(compare(records)))
    print(f"report: {out / 'report.md'}  ({len(written)} files; summary.csv, summary.json, study.json, plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
