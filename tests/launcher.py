"""Runs through the real ``deepspeed`` launcher (the venv's), several at once if need be, each in
its own process group: a launch that runs past its time or fails while another still runs has
every process group it started killed, so no rank outlives the test."""
from __future__ import annotations

import os
import signal
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
    ``bin`` first on PATH (the launcher starts the ranks with the python it finds first)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    return env


def deepspeed(*argv: str, cwd: Path = REPO, timeout: float = 600.0) -> Done:
    """``deepspeed ARGV`` in ``cwd``: its exit status and all its output."""
    return deepspeed_together([list(argv)], cwd=cwd, timeout=timeout)[0]


def deepspeed_together(argvs: list[list[str]], cwd: Path = REPO, timeout: float = 600.0) -> list[Done]:
    """One ``deepspeed`` launcher per argument list, all started at once (the nodes of one job);
    waits for all. On a timeout, or when one fails while the others still run (they would wait for
    it until their collective timeout), every launcher's process group is killed."""
    procs, logs = [], []
    try:
        for argv in argvs:
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen([str(BIN / "deepspeed"), *argv], cwd=cwd, env=launcher_env(),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
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
