"""Every command the tests start as a user would (the real ``deepspeed`` launcher, an example script, a
shell script), through one function: ``run_together``. Each command runs in its own process group with
its output captured; one that runs past its time, or whose job another command of failed while it still
runs, is killed with every process it started (its process group, and any descendant that left it), and
what one that ended by itself left in its process group is killed at the end, so no rank outlives the
test. A command's temporary files (``TMPDIR``) go to a directory of its own, removed afterwards.

    run([ARGV...], cwd=tmp_path, timeout=300)          # one command: its Done (status, output)
    run(argv, send=Signal(when=lambda: ..., to=...))   # SIGTERM to a process of it (group=True: its group) once when() holds
    deepspeed(ARGV...)                                 # ``deepspeed ARGV``
    deepspeed_together([ARGV, ...])                    # the nodes of one job (one failing stops the others)
    jobs([ARGV, ...], ranks=2)                         # independent jobs, each on a free port, /dev/shm checked
    assert_succeeded(*done)                            # fails with the output of the one that failed first

A test that starts ranks is marked ``@pytest.mark.slow`` (``make test-fast`` leaves it out); unmarked,
it fails here (see ``require_slow_mark``)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Done:
    """A finished command. ``output``: its stdout and stderr as a terminal shows them (stdout alone when
    run with ``split_stderr``, then ``stderr`` holds the rest). ``killed``: why this helper killed it
    (None: it exited by itself). ``signalled``: whether its ``Signal`` was sent."""
    status: int
    output: str
    stderr: str = ""
    killed: Optional[str] = None
    signalled: bool = False

    def tail(self, chars: int = 3000) -> str:
        """The end of its output (and of its stderr), headed by why it was killed, if it was."""
        head = f"[killed by the test harness: {self.killed}]\n" if self.killed else ""
        return head + self.output[-chars:] + (f"\n[stderr]\n{self.stderr[-chars:]}" if self.stderr else "")


@dataclass
class Signal:
    """``signum`` to one process of a running command, once, as soon as ``when()`` holds (it is asked
    every 50 ms). ``to`` picks the process from the command's own (a ``psutil.Process``); by default
    the command itself."""
    when: Callable[[], bool]
    to: Callable[[psutil.Process], psutil.Process] = lambda process: process
    signum: int = signal.SIGTERM
    group: bool = False   # to the command's whole process group instead (a scheduler that signals every process)


def launcher_env(**extra: str) -> dict:
    """The test's environment without the variables a launcher sets for its ranks, plus ``extra``; the
    venv's ``bin`` first on PATH (the launcher starts the ranks with the python it finds first). Only
    for a test marked slow (``require_slow_mark``)."""
    require_slow_mark("the deepspeed launcher")
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def require_slow_mark(what: str) -> None:
    """Fails a test that starts ranks (the launcher's, or spawned ones: ``tests/dist.py``, one rank
    included) without ``@pytest.mark.slow``, which ``make test-fast`` would run. tests/conftest.py
    sets what the marker says before the test's fixtures are set up; outside pytest nothing is checked."""
    if os.environ.get("MOE_PLUGIN_TEST_SLOW") == "0":
        raise RuntimeError(f"{what} starts ranks: mark the test @pytest.mark.slow "
                           "(make test-fast leaves such tests out)")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run(argv: Sequence[str], cwd: Path = REPO, timeout: float = 600.0, env: Optional[dict] = None,
        send: Optional[Signal] = None, split_stderr: bool = False) -> Done:
    """``argv`` in ``cwd`` (environment: ``launcher_env()`` updated with ``env``); ``send``: a signal
    delivered while it runs. Returns its ``Done``."""
    return run_together([argv], cwd=cwd, timeout=timeout, env=env, sends=[send], split_stderr=split_stderr)[0]


def deepspeed(*argv: str, cwd: Path = REPO, timeout: float = 600.0, send: Optional[Signal] = None) -> Done:
    """``deepspeed ARGV`` in ``cwd``: its exit status and all its output."""
    return run([str(BIN / "deepspeed"), *argv], cwd=cwd, timeout=timeout, send=send)


def deepspeed_together(argvs: list[list[str]], cwd: Path = REPO, timeout: float = 600.0,
                       independent: bool = False) -> list[Done]:
    """One ``deepspeed`` launcher per argument list, all started at once: the nodes of one job (when
    one fails, the others are killed: they would wait for it until their collective timeout; check
    them with ``assert_succeeded``), or with ``independent`` separate jobs."""
    return run_together([[str(BIN / "deepspeed"), *argv] for argv in argvs], cwd=cwd, timeout=timeout,
                        independent=independent)


def jobs(argvs: list[list[str]], cwd: Path = REPO, ranks: int = 2, timeout: float = 600.0,
         leaves_shm: tuple[int, ...] = ()) -> list[Done]:
    """``deepspeed --num_gpus RANKS --master_port PORT ARGV`` per argument list, each job on its own
    free port, all at once and independent (one failing stops no other). Afterwards DeepSpeed's
    shared-memory buffers of every job are removed from ``/dev/shm``; finding any fails the call,
    except for the jobs whose index is in ``leaves_shm`` (a script without the plugin, which is what
    unlinks them)."""
    from moe_plugin.compat.shm_buffers import job_shm_buffers

    ports = free_ports(len(argvs))
    try:
        return deepspeed_together([["--num_gpus", str(ranks), "--master_port", str(port), *argv]
                                   for port, argv in zip(ports, argvs)], cwd=cwd, timeout=timeout, independent=True)
    finally:
        left = {i: job_shm_buffers("127.0.0.1", str(port)) for i, port in enumerate(ports)}
        for path in (path for paths in left.values() for path in paths):
            path.unlink(missing_ok=True)
        left = {i: paths for i, paths in left.items() if paths and i not in leaves_shm}
        assert not left, f"jobs left their /dev/shm buffers: {left}"


def assert_succeeded(*done: Done, chars: int = 3000) -> None:
    """Every command exited 0 by itself; otherwise fails with the output of the one that failed first
    (a command killed because another of its job failed comes after that one; one killed past its time
    fails whatever its status: a script may clean up after SIGTERM and exit 0)."""
    failed = sorted((i for i, d in enumerate(done) if d.status != 0 or d.killed is not None),
                    key=lambda i: done[i].killed is not None)
    if failed:
        first = done[failed[0]]
        raise AssertionError(f"command {failed[0]} of {len(done)} exited with {first.status} "
                             f"(statuses {[d.status for d in done]}):\n{first.tail(chars)}")


def run_together(argvs: list[Sequence[str]], cwd: Path = REPO, timeout: float = 600.0, env: Optional[dict] = None,
                 independent: bool = False, sends: Optional[list[Optional[Signal]]] = None,
                 split_stderr: bool = False) -> list[Done]:
    """Every ``argv`` started at once in ``cwd``, each in its own process group, its output in a file;
    waits for all. Unless ``independent``, they are one job: the first one to fail has the others
    killed. Past ``timeout`` seconds each one still running gets SIGTERM (a script cleans up), and 10 s
    later SIGKILL with every process it started. ``sends[i]``: a ``Signal`` for command ``i``."""
    sends = sends or [None] * len(argvs)
    environment = launcher_env(**(env or {}))   # refuses a test not marked slow
    temp = Path(tempfile.mkdtemp(prefix="moe-test-run-"))   # the logs, and TMPDIR unless env names one
    procs, logs, done = [], [], {}
    try:
        if "TMPDIR" not in (env or {}):
            environment["TMPDIR"] = str(temp / "tmp")
            (temp / "tmp").mkdir()
        for i, argv in enumerate(argvs):
            logs.append((_log(temp / f"{i}.out"), _log(temp / f"{i}.err") if split_stderr else None))
            procs.append(subprocess.Popen(list(argv), cwd=cwd, env=environment, stdout=logs[i][0],
                                          stderr=logs[i][1] or subprocess.STDOUT, start_new_session=True))
        signalled = [False] * len(argvs)
        deadline = time.monotonic() + timeout
        while len(done) < len(procs):
            for i, proc in enumerate(procs):
                if i not in done and proc.poll() is not None:
                    done[i] = None
                    if proc.returncode != 0 and not independent:
                        why = f"command {i} of the job failed first (status {proc.returncode})"
                        done.update({j: why for j in _stop(procs, done, signal.SIGKILL)})
                elif i not in done and sends[i] is not None and not signalled[i] and sends[i].when():
                    signalled[i] = _send(proc, sends[i])
            if len(done) < len(procs) and time.monotonic() > deadline:
                done.update({j: f"ran past its {timeout:.0f} s" for j in _stop(procs, done, signal.SIGTERM)})
            time.sleep(0.05)
        results = []
        for i, (proc, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0)
            if err is not None:
                err.seek(0)
            results.append(Done(proc.wait(), out.read(), err.read() if err else "", done[i], signalled[i]))
        return results
    finally:
        _stop(procs, {i: None for i, p in enumerate(procs) if p.poll() is not None}, signal.SIGKILL)
        for proc in procs:   # what a command that ended by itself left running in its process group
            if not psutil.pid_exists(proc.pid):   # (else its pid, and so maybe the group, is another's now)
                left = _group(proc.pid)
                _killpg(proc.pid, signal.SIGKILL)
                _until_dead(left)
        for out, err in logs:
            out.close()
            if err is not None:
                err.close()
        shutil.rmtree(temp, ignore_errors=True)


def _log(path: Path):
    return open(path, "w+", encoding="utf-8", errors="replace")


def _send(proc: subprocess.Popen, send: Signal) -> bool:
    try:
        if send.group:
            os.killpg(proc.pid, send.signum)
        else:
            send.to(psutil.Process(proc.pid)).send_signal(send.signum)
    except (psutil.NoSuchProcess, ProcessLookupError, StopIteration, IndexError):   # not started yet, or already gone: next time
        return False
    return True


def _stop(procs: list[subprocess.Popen], done: dict, signum: int, grace: float = 10.0) -> list[int]:
    """``signum`` to every still running command's process group; after SIGTERM, ``grace`` seconds to
    exit, then SIGKILL to the group and to every descendant the command had started (one in a session
    of its own included). Returns the indices of the commands it stopped."""
    running = [i for i, p in enumerate(procs) if i not in done and p.poll() is None]
    family = {}
    for i in running:
        try:
            family[i] = psutil.Process(procs[i].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family[i] = []
    for i in running:
        _killpg(procs[i].pid, signum)
    if signum != signal.SIGKILL:
        end = time.monotonic() + grace
        while time.monotonic() < end and any(procs[i].poll() is None for i in running):
            time.sleep(0.1)
    for i in running:
        _killpg(procs[i].pid, signal.SIGKILL)
        for child in family[i]:
            try:
                child.kill()   # psutil checks that the pid is still this process
            except psutil.NoSuchProcess:
                pass
        procs[i].wait()
    return running


def _group(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def _until_dead(processes: list[psutil.Process], timeout: float = 10.0) -> None:
    """Wait until each of ``processes`` is gone or a zombie (a SIGKILL is delivered when the process
    next runs: on a loaded machine, later than the kill returns)."""
    end = time.monotonic() + timeout
    for p in processes:
        while time.monotonic() < end:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def _killpg(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)   # the command and every process of its group
    except ProcessLookupError:
        pass
