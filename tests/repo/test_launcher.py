"""The tests' own harness (``tests/launcher.py``, ``tests/dist.py``) on small shell commands:

* the commands of one job: the one that fails first is named, with its output, by ``assert_succeeded``;
  the others are killed and say so;
* a command past its time gets SIGTERM (it may clean up), then it and every process it started
  (one in a session of its own included) are killed;
* a ``Signal`` reaches the command once its condition holds;
* a command's temporary directory (``TMPDIR``) is removed afterwards, and a failing spawn leaves no
  traceback file of torch's in the system's temporary directory.
"""
from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import psutil
import pytest

from dist import run_distributed
from launcher import Signal, assert_succeeded, run, run_together

pytestmark = pytest.mark.slow   # starts several processes


def test_the_command_that_failed_first_is_named_with_its_output(tmp_path):
    # command 1 fails once command 0 has started: 0 and 2 would run a minute
    started = tmp_path / "started"
    argvs = [["sh", "-c", f"echo zero; touch {started}; sleep 60"],
             ["sh", "-c", f"while [ ! -e {started} ]; do sleep 0.05; done; echo the reason; exit 3"],
             ["sh", "-c", "echo two; sleep 60"]]
    zero, one, two = run_together(argvs, cwd=tmp_path, timeout=120)
    assert (zero.status, one.status, two.status) == (-signal.SIGKILL, 3, -signal.SIGKILL)
    assert one.killed is None and zero.killed == two.killed == "command 1 of the job failed first (status 3)"
    with pytest.raises(AssertionError) as failure:
        assert_succeeded(zero, one, two)
    assert str(failure.value) == "command 1 of 3 exited with 3 (statuses [-9, 3, -9]):\nthe reason\n"
    assert "[killed by the test harness: command 1 of the job failed first (status 3)]\nzero\n" == zero.tail()
    assert_succeeded(*run_together([["true"], ["sh", "-c", "echo x"]], timeout=60))


def test_independent_commands_run_on_when_one_fails(tmp_path):
    failed, ok = run_together([["sh", "-c", "exit 2"], ["sh", "-c", "sleep 1; echo done"]], independent=True,
                              timeout=60)
    assert (failed.status, failed.killed, ok.status, ok.killed, ok.output) == (2, None, 0, None, "done\n")


def test_past_its_time_a_command_gets_sigterm_then_all_it_started_is_killed(tmp_path):
    pid_file = tmp_path / "pid"   # a child in a session of its own: out of reach of the group's signal
    done = run(["sh", "-c", f"setsid sleep 300 & echo $! > {pid_file}; sleep 300"], cwd=tmp_path, timeout=2)
    assert done.status == -signal.SIGTERM and done.killed == "ran past its 2 s", done.tail()
    orphan = int(pid_file.read_text())
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE

    cleans_up = run(["sh", "-c", "trap 'echo cleaned up; exit 0' TERM; sleep 300 & wait"], timeout=2)
    assert (cleans_up.status, cleans_up.output) == (0, "cleaned up\n"), cleans_up.tail()
    with pytest.raises(AssertionError, match=r"killed by the test harness: ran past its 2 s\]\ncleaned up"):
        assert_succeeded(cleans_up)   # status 0, but past its time: not a success


def test_a_signal_reaches_the_command_once_its_condition_holds(tmp_path):
    ready = tmp_path / "ready"
    done = run(["sh", "-c", f"trap 'echo got USR1; exit 0' USR1; touch {ready}; sleep 300 & wait"], cwd=tmp_path,
               timeout=60, send=Signal(ready.exists, signum=signal.SIGUSR1))
    assert (done.status, done.output, done.signalled, done.killed) == (0, "got USR1\n", True, None)
    assert not run(["true"], send=Signal(lambda: False)).signalled


def test_the_temporary_directory_of_a_command_is_removed(tmp_path):
    done = run(["sh", "-c", 'touch "$TMPDIR/left"; echo "$TMPDIR"; echo err >&2'], split_stderr=True, timeout=60)
    assert done.status == 0 and done.stderr == "err\n" and "/moe-test-run-" in done.output
    assert not Path(done.output.strip()).parent.exists()
    assert run(["sh", "-c", 'echo "$TMPDIR"'], env={"TMPDIR": str(tmp_path)}, timeout=60).output == f"{tmp_path}\n"


def _fails(rank: int, world_size: int) -> None:
    raise ValueError(f"rank {rank} refuses")


def test_a_failing_spawn_leaves_no_torch_traceback_file(tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))   # where torch writes a failing rank's traceback
    with pytest.raises(ValueError, match=r"^rank \d refuses$"):
        run_distributed(_fails, 2, tmp_path, timeout=120)
    assert [p.name for p in temp.iterdir() if p.name.startswith("pytorch-errorfile-")] == []


def test_a_test_not_marked_slow_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MOE_PLUGIN_TEST_SLOW", "0")   # what tests/conftest.py sets for a test without the mark
    with pytest.raises(RuntimeError, match=r"^the deepspeed launcher starts ranks: mark the test @pytest.mark.slow"):
        run(["touch", str(tmp_path / "ran")])
    assert list(tmp_path.iterdir()) == []


def test_what_a_command_that_ended_by_itself_left_in_its_process_group_is_killed(tmp_path):
    pid_file = tmp_path / "pid"   # a launcher that exits while a rank of it still runs
    done = run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}"], cwd=tmp_path, timeout=60)
    assert (done.status, done.killed) == (0, None), done.tail()
    left = int(pid_file.read_text())
    assert not psutil.pid_exists(left) or psutil.Process(left).status() == psutil.STATUS_ZOMBIE
