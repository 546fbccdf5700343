"""The example's first losses, pinned: ``make example``'s job (``examples/gpt_moe/run_tiny_cpu.sh``:
4 CPU ranks under the ``deepspeed`` launcher, ZeRO-1, ep 2, GShard top-2, the stdlib corpus) for
its first 3 steps and one validation batch, fp32.

Training is deterministic run to run, so these numbers move only when a change moves them; such a
change says so, and why, in its commit message, and updates ``GOLDEN`` here. The corpus is the
Python stdlib of the interpreter that runs the example; its digest is pinned too, so another Python
fails here with that reason instead of a loss difference.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from launcher import REPO, launcher_env

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

RUN = REPO / "examples" / "gpt_moe" / "run_tiny_cpu.sh"
CORPUS = "884489dc84d9"   # sha256 prefix of the 4 MiB stdlib corpus of Python 3.11.7
# The train losses of steps 1-3 and the validation loss after step 3, measured 2026-11-25 at f2ad9bd.
GOLDEN = {"train": [5.983171463012695, 5.981719493865967, 5.983328819274902], "valid": [5.52057409286499]}


def test_make_example_first_losses(tmp_path, launcher_port):
    argv = [str(RUN), "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1",
            "--run-dir", str(tmp_path / "run"), "--data-cache", str(tmp_path / "data"), "--no-plot"]
    env = {**launcher_env(), "MASTER_PORT": str(launcher_port)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the launcher and every rank it started
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    digest = re.search(r"stdlib corpus: .* sha256 (\w+)", output)
    assert digest and digest.group(1) == CORPUS, (
        f"the stdlib corpus is another one ({digest.group(1) if digest else 'no data line'}, pinned {CORPUS}): "
        "another Python version; the golden losses hold for Python 3.11.7's stdlib")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = {split: [r["loss"] for r in records if r["split"] == split] for split in GOLDEN}
    for split, losses in GOLDEN.items():
        assert got[split] == pytest.approx(losses, rel=1e-6, abs=0), (split, got[split], losses)
