"""The GPT-MoE example (``examples/gpt_moe/pretrain_gpt_moe.py``) as the tests run it: its ``main`` on
spawned gloo ranks, as the ``deepspeed`` launcher would start it (RANK, LOCAL_RANK, WORLD_SIZE set),
or the script under the launcher itself (``tests/launcher.py``).

    MODEL_FLAGS, MOE                        # a tiny model (2 layers, hidden 32) and its "moe" block
    ds_config(path, world_size, expert=2)   # the DeepSpeed JSON: global batch 8 of micro-batches of 4
    run_distributed(run_main, 2, tmp_path, argv)   # [{"status": 0}, {"status": 0}]
    train(tmp_path, "dp2", 2, expert=2)     # the same, checked, and the run's metrics.jsonl records
    example_script().main(argv)             # in this process (for the checks made before any rank)

    TINY, tiny_config(tmp_path, "name", **changes)   # the runs through the launcher: a smaller model, and
                                                      # configs/tiny_cpu_4rank.json at a global batch of 8
    train_losses(run_dir)                   # {step: loss} of a run's metrics.jsonl
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

from dist import run_distributed
from ds_json import write_ds_config

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
TINY_CPU = SCRIPT.parent / "configs" / "tiny_cpu_4rank.json"
STEPS = 8
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
               "--seq-length", "32", "--train-iters", str(STEPS), "--eval-interval", "4", "--eval-iters", "1",
               "--log-interval", "4", "--seed", "7", "--corpus-bytes", str(192 * 1024), "--valid-fraction", "0.25"]
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "capacity_factor": 1.5, "min_capacity": 2,
       "aux_loss_coeff": 0.01, "layer_interval": 1}


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
        "--seq-length", "32", "--eval-interval", "0", "--eval-iters", "1", "--log-interval", "1",
        "--corpus-bytes", str(192 * 1024), "--valid-fraction", "0.25"]


def example_script():
    """The example script as a module (loaded afresh: its flags' defaults are read at load time)."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def ds_config(path: Path, world_size: int, **moe_parallel) -> Path:
    """Global batch 8 of micro-batches of 4: one rank accumulates 2, two ranks take one each."""
    monitor = {"enabled": True, "output_path": str(path.parent / "monitor" / path.stem), "job_name": "gpt"}
    return Path(write_ds_config(path, batch=8, micro=4, gas=2 // world_size, moe=MOE, parallel=moe_parallel,
                                csv_monitor=monitor))


def tiny_config(tmp_path: Path, name: str = "tiny", **changes) -> Path:
    """``configs/tiny_cpu_4rank.json`` at a global batch of 8, without its csv monitor, with top-level
    keys replaced by ``changes``, written to ``tmp_path/NAME.json``."""
    config = {**json.loads(TINY_CPU.read_text()), "train_batch_size": 8, "csv_monitor": {"enabled": False}, **changes}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def train_losses(run_dir: Path) -> dict[int, float]:
    """{step: training loss} of the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def run_main(rank: int, world_size: int, argv: list) -> dict:
    """The example's ``main`` on a spawned rank: its exit status."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    return {"status": example_script().main(argv)}


def run_main_printing(rank: int, world_size: int, argv: list) -> dict:
    """``run_main`` with what the rank printed (stdout and stderr) as ``"out"`` (the fork server's
    descriptors are those of the test that started it, so capfd cannot be relied on)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = example_script().main(argv)
    return {"status": status, "out": out.getvalue()}


def train(tmp_path: Path, name: str, world_size: int, *extra: str, **moe_parallel) -> list[dict]:
    """``MODEL_FLAGS`` on ``world_size`` ranks into ``tmp_path/runs/NAME`` (data in ``tmp_path/data``):
    every rank exits 0 and the plot is written; returns the records of its metrics.jsonl."""
    run_dir = tmp_path / "runs" / name
    argv = [*MODEL_FLAGS, "--deepspeed_config", str(ds_config(tmp_path / f"{name}.json", world_size, **moe_parallel)),
            "--run-dir", str(run_dir), "--data-cache", str(tmp_path / "data"), *extra]
    results = run_distributed(run_main, world_size, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [0] * world_size
    assert (run_dir / "metrics.png").stat().st_size > 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
