"""examples/gpt_moe/gpu_check.{sh,py} on a machine without a GPU: the shell script's syntax and its
refusal, and the python checks' logic on the CPU (the same code path as on CUDA but the device):
the layer against the loop oracle for every backend, the 2-rank EP check under the torch
launcher (gloo), a check that must fail when the layer is wrong, and the merged JSON."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher import REPO, run

ROOT = REPO
EXAMPLE = ROOT / "examples" / "gpt_moe"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", EXAMPLE / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shell_script_parses_and_refuses_a_machine_without_cuda(tmp_path):
    subprocess.run(["bash", "-n", str(EXAMPLE / "gpu_check.sh")], check=True)
    done = subprocess.run(["bash", str(EXAMPLE / "gpu_check.sh"), str(tmp_path / "out")], env=
                          {**ENV, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True)
    assert done.returncode == 2, done
    assert done.stderr.strip() == "error: gpu_check.sh needs a CUDA device (torch finds none)"
    # --wheels DIR (a machine without network): DIR must be a wheelhouse (tests/e2e/test_wheelhouse.py installs one)
    done = subprocess.run(["bash", str(EXAMPLE / "gpu_check.sh"), "--wheels", str(tmp_path / "none"),
                           str(tmp_path / "out")], env={**ENV, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True)
    assert done.returncode == 2, done
    assert done.stderr.strip() == (f"error: {tmp_path / 'none'}: not a wheelhouse (no requirements.txt); make one "
                                   "with `make wheelhouse` where pip works")


def test_oracle_check_on_the_cpu(capsys):
    gpu_check = _module()
    torch.set_num_threads(1)
    assert gpu_check.main(["oracle", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ran = {(r["dtype"], r["case"], r["backend"]) for r in records if r["ok"]}
    assert ran == {(d, c, b) for d in ("fp32", "bf16") for c in ("dropless", "capacity")
                   for b in ("loop", "bmm", "grouped_mm", "auto")}
    assert all(r["same_routes"] for r in records)


def test_oracle_check_fails_on_a_wrong_layer(monkeypatch):
    gpu_check = _module()
    real_step = gpu_check.train_step
    monkeypatch.setattr(gpu_check, "train_step", lambda layer, x, g: real_step(layer, x, g) * 1.01)
    record = gpu_check.oracle_case("dropless", "loop", torch.device("cpu"), "fp32")
    assert not record["ok"] and record["max_abs_diff"]["out"] > 1e-3


@pytest.mark.slow
def test_ep2_check_under_the_launcher_on_the_cpu():
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(EXAMPLE / "gpu_check.py"), "ep2", "--device", "cpu"], env={"PYTHONPATH": str(ROOT)},
               split_stderr=True)
    assert done.status == 0, done.tail()
    records = [json.loads(line) for line in done.output.splitlines() if line.startswith("{")]
    assert [(r["dtype"], r["case"]) for r in records] == [("fp32", "dropless"), ("fp32", "capacity"),
                                                         ("bf16", "dropless"), ("bf16", "capacity")]
    assert all(r["ok"] and r["ranks"] == 2 and r["backend"] == "gloo" for r in records), records


def test_collect_merges_a_run_directory(tmp_path, capsys):
    gpu_check = _module()
    (tmp_path / "oracle.status").write_text("0\n")
    (tmp_path / "oracle.jsonl").write_text('{"check": "oracle", "ok": true}\n')
    (tmp_path / "ep2.status").write_text("skip: 1 GPU: the 2-rank check needs 2\n")
    assert gpu_check.main(["collect", str(tmp_path)]) == 0
    (tmp_path / "bench_megatron.status").write_text("1\n")
    assert gpu_check.main(["collect", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.endswith("gpu_check.json")] == [str(tmp_path / "gpu_check.json")] * 2
    rows = {line.split()[0]: line.split()[1] for line in out if line.split()[0] in ("oracle", "ep2", "bench_megatron")}
    assert rows == {"oracle": "ok", "ep2": "skipped", "bench_megatron": "failed"}, out   # the printed table
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not result["ok"] and set(result["machine"]) == {"host", "torch", "cuda", "gpus"}
    checks = result["checks"]
    assert checks["oracle"] == {"status": "ok", "exit_code": 0, "note": None,
                                "records": [{"check": "oracle", "ok": True}]}
    assert checks["ep2"]["status"] == "skipped" and checks["ep2"]["note"].startswith("skip: 1 GPU")
    assert checks["bench_megatron"]["status"] == "failed" and checks["bench_megatron"]["exit_code"] == 1


@pytest.mark.slow
def test_recipe_check_measures_throughput_and_memory_on_the_cpu(tmp_path, capsys, monkeypatch):
    """``gpu_check.py recipe --tiny``: the GPU recipe's JSON (bf16, ZeRO-1, its router) on a small model,
    20 steps through the torch launcher; its record has the throughput, the step time, the memory peak
    against the run summary's estimate (no MFU on the CPU: no bf16 peak to compare with); the table shows it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    gpu_check = _module()
    assert gpu_check.main(["recipe", str(tmp_path / "recipe"), "--ranks", "1", "--tiny"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["ok"] and len(record["losses"]) == gpu_check.RECIPE_STEPS and record["mfu"] is None, record
    assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0 and record["flops_per_token"] > 0
    assert 0.3 < record["memory_peak_over_estimate"] < 1.5, record   # RSS on the CPU, within the estimate's reach
    assert json.loads((tmp_path / "recipe" / "recipe.json").read_text())["bf16"] == {"enabled": True}
    (tmp_path / "recipe.status").write_text("0\n")
    (tmp_path / "recipe.jsonl").write_text(json.dumps(record) + "\n")
    assert gpu_check.main(["collect", str(tmp_path)]) == 0
    assert "tokens/s, step" in capsys.readouterr().out


@pytest.mark.slow
def test_example_check_runs_the_example_under_every_layout_on_the_cpu(tmp_path, capsys, monkeypatch):
    """``gpu_check.py example --ranks 2``: the example itself under the torch launcher (gloo here, the
    GPUs there), 1 rank and three 2-rank layouts, each with the 1-rank run's losses."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # torch.distributed.run's log directories, which it leaves
    gpu_check = _module()
    assert gpu_check.main(["example", str(tmp_path), "--ranks", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["layout"], r["ranks"]) for r in records] == [("1rank", 1), ("tp2-ep2", 2), ("tp2sp-ep2", 2),
                                                           ("dp2-ep2", 2)]
    one = records[0]["losses"]
    assert len(one) == gpu_check.EXAMPLE_STEPS and one[-1] < one[0]
    for r in records[1:]:
        assert r["ok"] and r["exit_code"] == 0 and r["reference"] == "1rank", r
        assert r["losses"] == pytest.approx(one, rel=gpu_check.EXAMPLE_RTOL) and r["max_rel_diff"] <= 1e-4, r
    assert not [p for p in Path("/dev/shm").glob("deepspeed_*") if str(tmp_path) in p.name]


@pytest.mark.slow
def test_example_check_fails_on_a_failing_run_or_other_losses(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # torch.distributed.run's log directories, which it leaves
    gpu_check = _module()
    monkeypatch.setattr(gpu_check, "EXAMPLE_LAYOUTS", {"1rank": (1, {"expert": 3}), "ep2": (2, {"expert": 2})})
    assert gpu_check.main(["example", str(tmp_path), "--ranks", "1"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert records[0]["exit_code"] != 0 and not records[0]["ok"], records   # torch.distributed.run: 1
    assert "moe.parallel.expert: got 3" in records[0]["error"], records
    assert records[1] == {"check": "example", "layout": "ep2", "ranks": 2, "skipped": "needs 2 ranks, --ranks 1"}
    steps = gpu_check.EXAMPLE_STEPS
    assert gpu_check.compare_losses([5.0] * steps, [5.0] * steps) == (True, 0.0)
    assert not gpu_check.compare_losses([5.0] * (steps - 1) + [5.01], [5.0] * steps)[0]
    assert not gpu_check.compare_losses([5.0] * (steps - 1) + [float("nan")], None)[0]
