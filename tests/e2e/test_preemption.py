"""Preemption and time limits (``moe_plugin.ExitRequest``, the example's ``--exit-signal-handler`` and
``--exit-duration-in-mins``; docs/long_runs.md, *Preemption and time limits*).

* on 2 spawned ranks: a SIGTERM that reaches one rank stops both after the same step with the same
  reason (the other rank was never signalled); SIGUSR1 alike; a wall-time limit passed on one rank's
  clock stops both; nothing stops a run without a signal or a limit; ``close`` gives the previous
  handlers back. Without the handler the signalled rank dies and the test fails.
* the example refuses the flags without ``--save`` in one line, before writing anything; with
  ``--exit-duration-in-mins`` (2 spawned ranks running its ``main``) both ranks save the step and
  return 75.
* through the real ``deepspeed`` launcher, 2 ranks, a tiny model: SIGTERM to the launcher
  (``deepspeed.launcher.launch``) once a step is done -> the ranks save a tag for the step they
  agreed on and leave (the launcher, signalled itself, exits 1); ``--load`` resumes it, SIGTERM to
  rank 1 alone -> a second tag and the launcher exits with the ranks' status 75; the resumed steps'
  losses equal an uninterrupted run's (the example's ``main`` on 2 spawned ranks; rel 1e-5).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from dist import run_distributed
from example_runs import SCRIPT, TINY, TINY_CPU, example_script, run_main_printing, tiny_config, train_losses
from launcher import Done, Signal, deepspeed, run
from moe_plugin.integration.preemption import EXIT_STATUS, ExitRequest


# -- the agreement, 2 spawned ranks -------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stops(request: ExitRequest, kick, steps: int = 8):
    """(step, reason) of the first step after which ``request`` stops, or (None, None); ``kick(step)``
    runs during each step (a signal to this process, a clock moved)."""
    try:
        for step in range(1, steps + 1):
            kick(step)
            reason = request.after_step(step)
            if reason is not None:
                return step, reason
        return None, None
    finally:
        request.close()


def _agree_child(rank: int, world_size: int) -> dict:
    out = {"before": signal.getsignal(signal.SIGTERM)}

    def signal_on(who: int, at: int, signum: int):
        return lambda step: os.kill(os.getpid(), signum) if rank == who and step == at else None

    out["sigterm"] = _stops(ExitRequest(), signal_on(1, 3, signal.SIGTERM))
    out["after_close"] = signal.getsignal(signal.SIGTERM)
    out["sigusr1"] = _stops(ExitRequest(), signal_on(0, 2, signal.SIGUSR1))
    clock = FakeClock()

    def late_on_rank1(step: int) -> None:   # rank 1's clock passes the minute during step 4
        clock.now = 61.0 if rank == 1 and step >= 4 else 10.0 * step / 4
    out["duration"] = _stops(ExitRequest(signals=False, duration_mins=1, clock=clock), late_on_rank1)
    out["nothing"] = _stops(ExitRequest(duration_mins=60), lambda step: None)
    return out


@pytest.mark.slow
def test_one_rank_signalled_or_late_stops_every_rank_after_the_same_step(tmp_path):
    results = run_distributed(_agree_child, 2, tmp_path, timeout=120)
    for r in results:
        assert r["sigterm"] == (3, "step 3: SIGTERM received")
        assert r["sigusr1"] == (2, "step 2: SIGUSR1 received")
        assert r["duration"] == (4, "step 4: the wall time passed 1 minutes")
        assert r["nothing"] == (None, None)
        assert r["after_close"] == r["before"]


def test_exit_request_refuses_a_duration_that_is_not_positive():
    with pytest.raises(ValueError, match=r"^duration_mins: got 0; expected a number of minutes > 0, or None$"):
        ExitRequest(signals=False, duration_mins=0)
    assert not ExitRequest(signals=False).enabled and ExitRequest(signals=False).after_step(1) is None


# -- the example's flags ------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, line", [
    (["--exit-signal-handler"], "error: --exit-signal-handler: got True; it saves a checkpoint before it exits: "
                                "pass --save DIR too"),
    (["--exit-duration-in-mins", "30"], "error: --exit-duration-in-mins: got 30.0; it saves a checkpoint before "
                                        "it exits: pass --save DIR too"),
    (["--exit-duration-in-mins", "0", "--save", "x"], "error: --exit-duration-in-mins: got 0.0; expected "
                                                      "minutes > 0"),
])
def test_example_refuses_the_exit_flags_without_save_before_writing_anything(tmp_path, capsys, flags, line):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    status = example_script().main(["--deepspeed_config", str(TINY_CPU), "--run-dir", str(run_dir), "--data-cache",
                                    str(data), *flags])
    out = capsys.readouterr()
    assert status == 2
    assert [x for x in (out.out + out.err).splitlines() if x.startswith("error: ")] == [line]
    assert not run_dir.exists() and not data.exists()


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One stdlib corpus for the example runs of this module (written by the first)."""
    return tmp_path_factory.mktemp("data")


@pytest.mark.slow
def test_example_exit_duration_saves_and_exits_75_on_every_rank(tmp_path, data_cache):
    ckpt = tmp_path / "ckpt"
    argv = ["--deepspeed_config", str(tiny_config(tmp_path)), *TINY, "--run-dir", str(tmp_path / "run"),
            "--data-cache", str(data_cache), "--train-iters", "50", "--save", str(ckpt),
            "--exit-duration-in-mins", "0.001"]   # 60 ms: over before the first step ends
    results = run_distributed(run_main_printing, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [EXIT_STATUS, EXIT_STATUS], results[0]["out"][-3000:]
    assert "step 1: the wall time passed 0.001 minutes: saved checkpoint step1 to " in results[0]["out"]
    assert (ckpt / "latest").read_text().strip() == "step1" and max(train_losses(tmp_path / "run")) == 1


# -- through the deepspeed launcher -------------------------------------------------------------------
def _launch(tmp_path: Path, port: int, data: Path, run_dir: Path, *flags: str, signal_to: str | None = None,
            after_step: int = 0) -> Done:
    """The example through ``deepspeed`` (2 ranks). ``signal_to``: "launcher" (DeepSpeed's
    ``launch.py``, which the ``deepspeed`` command starts) or "rank1", sent SIGTERM once
    ``run_dir``'s metrics show a step past ``after_step``."""
    def past_the_step() -> bool:
        try:
            return max(train_losses(run_dir), default=0) > after_step
        except (FileNotFoundError, ValueError):   # not written yet, or its last line half written
            return False

    def target(command: psutil.Process) -> psutil.Process:
        launch = command.children()[0]   # python -m deepspeed.launcher.launch
        return launch if signal_to == "launcher" else next(
            p for p in launch.children() if "--local_rank=1" in p.cmdline())

    return deepspeed("--num_gpus", "2", "--master_port", str(port), str(SCRIPT), "--deepspeed_config",
                     str(tiny_config(tmp_path)), *TINY, "--run-dir", str(run_dir), "--data-cache", str(data), *flags,
                     cwd=tmp_path, send=Signal(past_the_step, target) if signal_to else None)


def _left(output: str) -> int:
    """The step the ranks agreed on, from rank 0's line; fails when there is none."""
    lines = [x for x in output.splitlines() if ": SIGTERM received: saved checkpoint step" in x]
    assert len(lines) == 1, output[-3000:]
    step = int(lines[0].split()[1].rstrip(":"))
    assert lines[0].endswith(f"exiting with status {EXIT_STATUS} (resume with --load {lines[0].split()[-1][:-1]})")
    return step


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_that_step_and_load_continues_the_run(tmp_path, launcher_port, data_cache):
    iters = "60"   # far more steps than the signal needs to arrive: a run that ends first fails below
    ckpt = tmp_path / "ckpt"
    flags = ("--train-iters", iters, "--save", str(ckpt), "--exit-signal-handler")
    done = _launch(tmp_path, launcher_port, data_cache, tmp_path / "cut", *flags, signal_to="launcher", after_step=1)
    first = _left(done.output)
    assert done.status == 1, done.tail()   # DeepSpeed's launch.py exits 1 after it forwarded a signal it got itself
    assert (ckpt / "latest").read_text().strip() == f"step{first}" and (ckpt / f"step{first}").is_dir()
    assert 1 < first < int(iters) and max(train_losses(tmp_path / "cut")) == first

    done = _launch(tmp_path, launcher_port, data_cache, tmp_path / "cut", *flags, "--load", str(ckpt),
                   signal_to="rank1", after_step=first + 1)
    second = _left(done.output)
    assert done.status == EXIT_STATUS, done.tail()   # a rank's own status, passed on by the launcher
    assert f"resumed from {ckpt} after {first} steps" in done.output
    assert (ckpt / "latest").read_text().strip() == f"step{second}" and first + 1 < second < int(iters)
    resumed = train_losses(tmp_path / "cut")
    assert sorted(resumed) == list(range(1, second + 1))

    # The uninterrupted run, for the steps the two launches trained: the example's main on 2 spawned ranks
    # (the launcher is what the launches above test; the batches and the learning rate of a step do not
    # depend on --train-iters)
    argv = ["--deepspeed_config", str(tiny_config(tmp_path)), *TINY, "--run-dir", str(tmp_path / "whole"),
            "--data-cache", str(data_cache), "--train-iters", str(second)]
    results = run_distributed(run_main_printing, 2, tmp_path, argv, timeout=300)
    assert [r["status"] for r in results] == [0, 0], results[0]["out"][-3000:]
    whole = train_losses(tmp_path / "whole")
    for step in range(1, second + 1):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5), step


# -- the launch scripts: examples/gpt_moe/forward_signals.sh (a container's entrypoint), slurm_job.sbatch -----
def _past(run_dir: Path, step: int):
    def when() -> bool:
        try:
            return max(train_losses(run_dir), default=0) > step
        except (FileNotFoundError, ValueError):
            return False
    return when


@pytest.mark.slow
def test_sigterm_to_the_entrypoint_alone_reaches_every_rank_and_it_exits_with_their_status(tmp_path, launcher_port,
                                                                                           data_cache):
    """What a container runtime does on stop (SIGTERM to its first process only): the entrypoint passes it to
    the ranks, which save the step and exit 75; the entrypoint waits for them and exits 75."""
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    done = run([str(SCRIPT.parent / "forward_signals.sh"), "deepspeed", "--num_gpus", "2", "--master_port",
                str(launcher_port), str(SCRIPT), "--deepspeed_config", str(tiny_config(tmp_path)), *TINY,
                "--run-dir", str(run_dir), "--data-cache", str(data_cache), "--train-iters", "60", "--save", str(ckpt),
                "--exit-signal-handler"], cwd=tmp_path, send=Signal(_past(run_dir, 1)))
    step = _left(done.output)
    assert done.signalled and done.status == EXIT_STATUS, done.tail()
    assert "forward_signals.sh: SIGTERM passed on to the ranks" in done.output
    assert (ckpt / "latest").read_text().strip() == f"step{step}" and 1 < step < 60


@pytest.mark.slow
def test_slurm_job_signalled_as_a_whole_saves_requeues_and_resumes(tmp_path, launcher_port, data_cache):
    """SLURM's way at a preemption or scancel (SIGTERM to every process of the job; here the script's
    whole process group): the ranks save and exit 75, the job script waits for the save, asks
    ``scontrol requeue`` for its job and exits 75; the requeued job (the same script again) resumes from
    the checkpoint. A stand-in ``scontrol`` on PATH records the call."""
    ckpt, run_dir, bin_dir = tmp_path / "ckpt", tmp_path / "run", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {"GPUS": "2", "CONFIG": str(tiny_config(tmp_path)), "CKPT": str(ckpt), "MASTER_PORT": str(launcher_port),
           "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    argv = ["bash", str(SCRIPT.parent / "slurm_job.sbatch"), *TINY, "--run-dir", str(run_dir), "--data-cache",
            str(data_cache), "--train-iters", "60"]
    done = run(argv, cwd=tmp_path, env=env, send=Signal(_past(run_dir, 1), group=True))
    step = _left(done.output)
    assert done.signalled and done.status == EXIT_STATUS, done.tail()
    assert (ckpt / "latest").read_text().strip() == f"step{step}"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    again = run([*argv[:-1], str(step + 2)], cwd=tmp_path, env=env)   # the requeued job: two more steps
    assert again.status == 0, again.tail()
    assert f"resumed from {ckpt} after {step} steps" in again.output
    assert (ckpt / "latest").read_text().strip() == f"step{step + 2}"
