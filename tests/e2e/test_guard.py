"""A run that stops learning stops; nothing is left in /dev/shm (``integration/guard.py``,
``compat/shm_buffers.py``, the example's ``--max-skipped-steps`` / ``--distributed-timeout-minutes``).

* the guard's rules on a fake engine (one process): fp32/bf16 stop at the first non-finite
  gradient, naming the step, the first parameter in model order (and its MoE layer) and the last
  checkpoint; fp16 stops after ``max_skipped_steps`` skipped in a row, not before; a step over
  10x the median step so far gives one line (a fake clock: no real timing);
* on 2 gloo ranks with DeepSpeed's engine: only rank 1 gets a NaN gradient, both ranks raise the
  same message naming rank 1's parameter; ``initialize(timeout=)`` reaches the plugin's groups (a
  collective with a sleeping peer fails after 2 s instead of waiting) and ``init_distributed``;
* the example through the real ``deepspeed`` launcher on 2 ranks (two jobs side by side): lr 1000 in fp32 exits 1
  within a few steps with one line naming the step, a parameter and the last checkpoint; a run
  that succeeds and one that fails leave no DeepSpeed buffer of the job in ``/dev/shm``;
* the example's ``main`` on 2 spawned ranks in fp16 with a loss scale that always overflows
  stops after ``--max-skipped-steps 3`` and ``metrics.jsonl`` counts the skipped steps;
* the version guard: DeepSpeed's shm.cpp still names its buffers as ``shm_buffers`` assumes.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from dist import fp16_answer, needs_fp16, run_distributed
from ds_json import ds_config
from example_runs import SCRIPT, TINY, TINY_CPU, example_script, tiny_config
from launcher import Done, jobs
from moe_plugin.integration.guard import GradientWatch, TrainingGuard, TrainingStopped


# -- the guard's rules, one process ------------------------------------------------------------------
class FakeEngine:
    """What the guard reads of DeepSpeed's engine; each step set by the test."""

    def __init__(self, fp16: bool = False):
        self.fp16, self.applied, self.norm, self.skipped_steps = fp16, True, 1.0, 0

    def fp16_enabled(self):
        return self.fp16

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return self.norm

    def step(self, applied=True, norm=1.0):
        self.applied, self.norm = applied, norm
        self.skipped_steps += not applied


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).sum()


def test_fp32_stops_at_the_first_nonfinite_gradient_naming_step_parameter_and_checkpoint(tmp_path):
    model, engine = TwoLayers(), FakeEngine()
    guard = TrainingGuard(engine, GradientWatch(model), checkpoint_dir=str(tmp_path / "ckpt"))
    model(torch.ones(2, 4)).backward()
    engine.step()
    health = guard.check(1)
    assert not health.skipped and health.stopped is None and health.skipped_steps == 0
    # step 2: a NaN reaches the second layer's bias only, through a hook on the loss path
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step1")
    model.zero_grad()
    out = model(torch.ones(2, 4))
    poison = model.second.bias.register_hook(lambda g: g * float("nan"))
    out.backward()
    poison.remove()
    engine.step(norm=float("nan"))
    with pytest.raises(TrainingStopped, match=r"^step 2: non-finite gradients \(global gradient norm nan\); first "
                                              r"parameter with a non-finite gradient norm: second.bias on rank 0; "
                                              rf"last checkpoint: {tmp_path}/ckpt/step1\. Training stopped") as stop:
        guard.check(2)
    assert stop.value.step == 2
    # the flags were reset: a clean step goes through; a step DeepSpeed skipped in fp32 stops too
    model.zero_grad()
    model(torch.ones(2, 4)).backward()
    engine.step()
    assert guard.check(3).stopped is None
    engine.step(applied=False, norm=float("inf"))
    health = guard.after_step(4)
    assert health.skipped and health.skipped_steps == 1
    assert "step 4: non-finite gradients (global gradient norm inf, the step was skipped)" in health.stopped
    assert "no parameter's gradient norm alone is non-finite; the largest: first.weight on rank 0 (" in health.stopped


def test_the_first_parameter_in_model_order_and_its_moe_layer_are_named():
    from moe_plugin.configs import MoEConfig
    from moe_plugin.layers import MoELayer

    class WithMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.moe = MoELayer(MoEConfig.from_dict({"num_experts": 2, "top_k": 1, "router": "topk"}), 8, 8,
                                None, seed=1)

        def forward(self, x_SBH):
            return self.moe(self.inp(x_SBH))[0].sum()

    model = WithMoE()
    watch = GradientWatch(model)
    model.moe.experts.weight1.register_hook(lambda g: g * float("inf"))
    model.moe.experts.weight2.register_hook(lambda g: g * float("nan"))
    model(torch.randn(3, 2, 8)).backward()
    first = watch.first_bad()
    assert watch.names[first] == "moe.experts.weight1"
    assert watch.describe(first) == "moe.experts.weight1 (an expert weight of the MoE layer moe)"
    with pytest.raises(TrainingStopped, match=r"first parameter with a non-finite gradient norm: moe.experts.weight1 "
                                              r"\(an expert weight of the MoE layer moe\) on rank 0; last checkpoint: "
                                              r"none \(no checkpoint"):
        TrainingGuard(FakeEngine(), watch).check(5)
    watch.remove()


def test_fp16_stops_after_max_skipped_steps_in_a_row():
    engine = FakeEngine(fp16=True)
    guard = TrainingGuard(engine, max_skipped_steps=3)
    for step, applied in enumerate([False, False, True, False, False], start=1):   # never 3 in a row
        engine.step(applied=applied, norm=float("inf") if not applied else 2.0)
        health = guard.check(step)
    assert health.consecutive_skips == 2 and health.skipped_steps == 4
    engine.step(applied=False, norm=float("inf"))
    with pytest.raises(TrainingStopped, match=r"^step 6: 3 steps in a row skipped for overflowing fp16 gradients "
                                              r"\(max_skipped_steps 3\); parameter not tracked"):
        guard.check(6)
    with pytest.raises(ValueError, match="max_skipped_steps: got 0; expected an integer >= 1"):
        TrainingGuard(engine, max_skipped_steps=0)


def test_a_step_ten_times_the_median_gives_one_line():
    now = [0.0]
    lines = []
    guard = TrainingGuard(FakeEngine(), log=lines.append, clock=lambda: now[0])
    for step, seconds in enumerate([5.0, 1.0, 1.2, 0.9, 1.1, 9.0, 30.0, 1.0], start=1):
        now[0] += seconds          # the clock: the time since the previous call is the step's
        health = guard.check(step)
        assert health.step_s == pytest.approx(seconds)
    # median after 5 steps: 1.1 (9.0 is under 10x); step 7: 30 s against 1.15 s
    assert lines == ["step 7: took 30.00 s, 26x the median step so far (1.150 s); a rank may have stalled "
                     "(swapping, a stopped process, a slow disk)"]
    assert guard.check(9, step_s=100.0).slow.startswith("step 9: took 100.00 s")   # the loop's own time
    fast = TrainingGuard(FakeEngine(), log=lines.append)
    for step, seconds in enumerate([0.01, 0.01, 0.01, 0.5], start=1):   # 50x, but half a second: jitter
        assert fast.check(step, step_s=seconds).slow is None


# -- DeepSpeed's engine on 2 ranks ---------------------------------------------------------------------
DS = ds_config(batch=4, micro=2, dp=2, optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero=0,
               zero_allow_untested_optimizer=True, moe={"num_experts": 2}, parallel={"expert": 2})


def _dense(moe_config, groups):
    torch.manual_seed(0)
    return TwoLayers()


def _nan_on_rank1(rank: int, world_size: int) -> dict:
    import moe_plugin

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    result = moe_plugin.initialize(DS, _dense)
    try:
        x = torch.ones(2, 4)
        engine = result.engine
        engine.backward(engine(x))
        engine.step()
        first = result.guard.check(1)
        if rank == 1:
            x[0, 0] = float("nan")
        engine.backward(engine(x))
        engine.step()
        try:
            result.guard.check(2)
        except TrainingStopped as err:
            return {"first": first.stopped, "message": str(err)}
        return {"first": first.stopped, "message": None}
    finally:
        result.close()


@pytest.mark.slow
def test_ranks_agree_and_name_the_rank_that_saw_the_gradient(tmp_path):
    results = run_distributed(_nan_on_rank1, 2, tmp_path, timeout=120)
    assert [r["first"] for r in results] == [None, None]
    assert results[0]["message"] == results[1]["message"]
    assert results[0]["message"].startswith("step 2: non-finite gradients (global gradient norm nan); first "
                                            "parameter with a non-finite gradient norm: first.weight on rank 1;"), \
        results[0]["message"]


def _timeout_child(rank: int, world_size: int) -> dict:
    import moe_plugin
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    result = moe_plugin.initialize(DS, _dense, timeout=datetime.timedelta(seconds=2))
    try:
        if rank == 1:
            time.sleep(8)
        began = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=result.groups.ep)   # the plugin's group of both ranks
            error = None
        except RuntimeError as err:
            error = str(err)
        return {"error": error, "waited_s": time.monotonic() - began}
    finally:
        result.close()


@pytest.mark.slow
def test_the_collective_timeout_reaches_the_plugins_groups(tmp_path):
    """Rank 1 sleeps 8 s; rank 0's all-reduce on the plugin's EP group fails after about 2 s
    (without the timeout it would wait for rank 1 and succeed)."""
    results = run_distributed(_timeout_child, 2, tmp_path, timeout=120)
    assert results[0]["error"] is not None and results[0]["waited_s"] < 6, results


def test_initialize_passes_the_timeout_to_init_distributed(monkeypatch):
    import deepspeed
    import moe_plugin

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(deepspeed, "init_distributed", fake_init)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="stop here"):
        moe_plugin.initialize({**DS, "train_batch_size": 2, "moe": {"num_experts": 2}}, _dense,
                              timeout=datetime.timedelta(minutes=3))
    assert seen["timeout"] == datetime.timedelta(minutes=3)
    from moe_plugin.configs import ConfigError

    with pytest.raises(ConfigError, match=r"^max_skipped_steps: got 0; expected an integer >= 1"):
        moe_plugin.initialize({**DS, "train_batch_size": 2, "moe": {"num_experts": 2}}, _dense,
                              max_skipped_steps=0)


# -- the example through the deepspeed launcher ----------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Path, Done]]:
    """Two jobs of the example through the launcher on 2 ranks, run side by side: "lr1000" (lr 1000 in
    fp32, up to 30 steps, a checkpoint every 2) and "ok" (2 steps). Name -> (its directory, its
    ``Done``); ``launcher.jobs`` fails unless both left their ``/dev/shm`` buffers removed."""
    root = tmp_path_factory.mktemp("launched")
    optimizer = {"type": "AdamW", "params": {"lr": 1000.0, "torch_adam": True}}
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 1000.0, "warmup_max_lr": 1000.0,
                                                "warmup_num_steps": 1}}
    flags = {"lr1000": ["--train-iters", "30", "--save", str(root / "lr1000" / "ckpt"), "--save-interval", "2"],
             "ok": ["--train-iters", "2"]}
    changes = {"lr1000": {"optimizer": optimizer, "scheduler": scheduler}, "ok": {}}
    argvs = []
    for name in flags:
        (root / name).mkdir()
        argvs.append([str(SCRIPT), "--deepspeed_config", str(tiny_config(root / name, name, **changes[name])), *TINY,
                      "--run-dir", str(root / name / "run"), "--data-cache", str(root / name / "data"), *flags[name]])
    return {name: (root / name, done) for name, done in zip(flags, jobs(argvs, cwd=root, ranks=2))}


def _errors(done: Done) -> list[str]:
    """The example's own error lines (the launcher prefixes nothing to its ranks' output)."""
    return [line for line in done.output.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_example_huge_lr_stops_with_one_line_and_leaves_no_shm(launched):
    job, done = launched["lr1000"]
    out = done.output
    assert done.status != 0, out[-3000:]
    errors = _errors(done)
    assert len(errors) == 1, out[-3000:]
    step = int(errors[0].split()[2].rstrip(":"))
    assert step <= 10, errors
    saved = (step - 1) // 2 * 2
    assert errors[0].startswith(f"error: step {step}: non-finite gradients (global gradient norm ")
    assert "; first parameter with a non-finite gradient norm: " in errors[0] or "; the largest: " in errors[0]
    assert " on rank " in errors[0]
    assert f"; last checkpoint: {job / 'ckpt'}/step{saved}." in errors[0]
    records = [json.loads(line) for line in (job / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step and records[-1]["skipped_steps"] == 1   # ZeRO-1 skipped it


def _main_child(rank: int, world_size: int, argv: list) -> dict:
    """The example's ``main`` on a spawned rank (as the launcher would start it), with what it
    printed (the fork server's descriptors are those of the test that started it, so capfd cannot
    be relied on)."""
    import contextlib
    import io

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    module = example_script()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = module.main(argv)
    return {"status": status, "out": out.getvalue(), "err": err.getvalue()}


def _error_lines(results: list) -> list[str]:
    return [line for r in results for line in (r["out"] + r["err"]).splitlines() if line.startswith("error: ")]


@pytest.mark.slow
@needs_fp16
def test_example_fp16_stops_after_max_skipped_steps(tmp_path):
    """A loss scale of 2^32 overflows fp16 at every step (the scale halves once per skipped step):
    with ``--max-skipped-steps 3`` the run stops at step 3, status 1 on every rank."""
    config = tiny_config(tmp_path, "fp16", fp16={"enabled": True, "initial_scale_power": 32, "hysteresis": 1})
    argv = ["--deepspeed_config", str(config), *TINY, "--train-iters", "20", "--max-skipped-steps", "3",
            "--run-dir", str(tmp_path / "run"), "--data-cache", str(tmp_path / "data")]
    results = run_distributed(_main_child, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [1, 1]
    errors = _error_lines(results)
    assert len(errors) == 1 and errors[0].startswith(
        "error: step 3: 3 steps in a row skipped for overflowing fp16 gradients (max_skipped_steps 3, loss scale now "
    ), errors
    assert "parameter with a non-finite gradient norm: " in errors[0] and "last checkpoint: none" in errors[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 1), (2, 2), (3, 3)]
    assert "| skipped 3" in results[0]["out"]


@pytest.mark.slow
@pytest.mark.skipif(not fp16_answer(), reason="DeepSpeed's accelerator takes fp16 on this machine")
def test_example_fp16_where_the_accelerator_has_none_is_one_line(tmp_path):
    """Where DeepSpeed's accelerator has no fp16 (a CPU without oneDNN's fp16 kernels), the example's
    fp16 run is one line naming the key and the accelerator's answer, status 2, before any group."""
    config = tiny_config(tmp_path, "fp16", fp16={"enabled": True})
    argv = ["--deepspeed_config", str(config), *TINY, "--train-iters", "2",
            "--run-dir", str(tmp_path / "run"), "--data-cache", str(tmp_path / "data")]
    results = run_distributed(_main_child, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [2, 2], results
    errors = _error_lines(results)
    assert errors == [f"error: fp16.enabled: got True; {fp16_answer()} (on a CPU: oneDNN has no fp16 "
                      "kernels here); use bf16 or fp32"], errors
    assert "Traceback" not in results[0]["err"] + results[1]["err"]


@pytest.mark.slow
def test_example_pipeline_engine_stops_too(tmp_path):
    """pp 2 (DeepSpeed's PipelineEngine, ``engine.train_batch``): lr 1000 stops the run the same way."""
    optimizer = {"type": "AdamW", "params": {"lr": 1000.0, "torch_adam": True}}
    moe = json.loads(TINY_CPU.read_text())["moe"]
    config = tiny_config(tmp_path, "pp2", optimizer=optimizer, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 1000.0, "warmup_max_lr": 1000.0, "warmup_num_steps": 1}}, train_batch_size=4,
        moe={**moe, "layer_interval": 1, "parallel": {"pipeline": 2}})
    argv = ["--deepspeed_config", str(config), *TINY, "--train-iters", "30", "--run-dir", str(tmp_path / "run"),
            "--data-cache", str(tmp_path / "data")]
    results = run_distributed(_main_child, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [1, 1]
    errors = _error_lines(results)
    assert len(errors) == 1 and " non-finite gradients (global gradient norm " in errors[0], errors
    assert " on rank " in errors[0] and "; last checkpoint: none (no checkpoint directory)." in errors[0]


@pytest.mark.slow
def test_example_success_leaves_no_shm(launched):
    job, done = launched["ok"]
    assert done.status == 0, done.output[-3000:]
    assert "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" in done.output
    records = [json.loads(line) for line in (job / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_steps") for r in records if r["split"] == "train"] == [0, 0]


def test_version_guard_deepspeed_names_its_shm_buffers_as_we_assume():
    import deepspeed

    from moe_plugin.compat.shm_buffers import BUFFER_PREFIX, DEEPSPEED_SOURCE, shm_buffer_name

    source = (Path(deepspeed.__file__).parent / DEEPSPEED_SOURCE).read_text()
    assert f'#define SHM_BUFFER_NAME "{BUFFER_PREFIX}"' in source, (
        f"DeepSpeed {deepspeed.__version__} renamed its shm buffers: update moe_plugin/compat/shm_buffers.py")
    assert '"%s_%d_%s_%s",\n             SHM_BUFFER_NAME,\n             getuid(),\n             addr_string,' in source
    assert 'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank);' in source
    assert shm_buffer_name(3, "127.0.0.1", "29500", uid=7) == "deepspeed_allreduce_buffer_7_127.0.0.1_29500_3"
