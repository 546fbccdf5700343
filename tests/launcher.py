"""Runs through the real ``deepspeed`` launcher (the venv's), several at once if need be, each in
its own process group: a launch that runs past its time, or fails while the other nodes of its job
still run, has every process group it started killed, so no rank outlives the test.

``deepspeed(ARGV)``: one launch; ``deepspeed_together([ARGV, ...])``: the nodes of one job, or
independent jobs (``independent=True``) run side by side; ``jobs([ARGV, ...], ranks=2)``: independent
jobs, each on a free port, that must leave nothing in ``/dev/shm``. A test that starts ranks is
marked ``@pytest.mark.slow`` (``make test-fast`` leaves it out); unmarked, it fails here (see
``require_slow_mark``)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    status: int
    output: str


def launcher_env() -> dict:
    """The test's environment without the variables a launcher sets for its ranks; the venv's
    ``bin`` first on PATH (the launcher starts the ranks with the python it finds first). Only for a
    test marked slow (``require_slow_mark``)."""
    require_slow_mark("the deepspeed launcher")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
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


def deepspeed(*argv: str, cwd: Path = REPO, timeout: float = 600.0) -> Done:
    """``deepspeed ARGV`` in ``cwd``: its exit status and all its output."""
    return deepspeed_together([list(argv)], cwd=cwd, timeout=timeout)[0]


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


def deepspeed_together(argvs: list[list[str]], cwd: Path = REPO, timeout: float = 600.0,
                       independent: bool = False) -> list[Done]:
    """One ``deepspeed`` launcher per argument list, all started at once (the nodes of one job, or
    with ``independent`` separate jobs); waits for all. On a timeout, or for the nodes of one job
    when one fails while the others still run (they would wait for it until their collective
    timeout), every launcher's process group is killed."""
    procs, logs = [], []
    try:
        for argv in argvs:
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen([str(BIN / "deepspeed"), *argv], cwd=cwd, env=launcher_env(),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = not independent and any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                _kill(procs)
                break
            time.sleep(0.5)
        done = []
        for proc, log in zip(procs, logs):
            log.seek(0)
            done.append(Done(proc.wait(), log.read()))
        return done
    finally:
        _kill(procs)
        for log in logs:
            log.close()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the launcher and every rank it started
            except ProcessLookupError:
                pass
            proc.wait()
