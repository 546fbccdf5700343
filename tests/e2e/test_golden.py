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
import re
import shutil

import pytest

from launcher import REPO, run

pytestmark = pytest.mark.slow   # through the deepspeed launcher or several processes

EXAMPLE = REPO / "examples" / "gpt_moe"
CORPUS = "884489dc84d9"   # sha256 prefix of the 4 MiB stdlib corpus of Python 3.11.7
# The train losses of steps 1-3 and the validation loss after step 3, measured 2026-11-25 at f2ad9bd.
GOLDEN = {"train": [5.983171463012695, 5.981719493865967, 5.983328819274902], "valid": [5.52057409286499]}


def test_make_example_first_losses(tmp_path, launcher_port):
    # The script runs the example from the directory two levels above its own, where the config's
    # csv_monitor writes (runs/tiny_cpu_4rank/monitor): a copy of examples/gpt_moe in tmp_path keeps
    # that out of the repository; every file of the job is the repository's, byte for byte.
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "gpt_moe", ignore=shutil.ignore_patterns("__pycache__"))
    argv = [str(tmp_path / "examples" / "gpt_moe" / "run_tiny_cpu.sh"), "--train-iters", "3", "--eval-interval", "3",
            "--eval-iters", "1", "--log-interval", "1", "--run-dir", str(tmp_path / "run"), "--data-cache",
            str(tmp_path / "data"), "--no-plot"]
    done = run(argv, cwd=tmp_path, env={"MASTER_PORT": str(launcher_port)}, timeout=540)
    output = done.output
    assert done.status == 0, done.tail()
    assert (tmp_path / "runs" / "tiny_cpu_4rank" / "monitor").is_dir()   # the monitor wrote where it was sent
    digest = re.search(r"stdlib corpus: .* sha256 (\w+)", output)
    assert digest and digest.group(1) == CORPUS, (
        f"the stdlib corpus is another one ({digest.group(1) if digest else 'no data line'}, pinned {CORPUS}): "
        "another Python version; the golden losses hold for Python 3.11.7's stdlib")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = {split: [r["loss"] for r in records if r["split"] == split] for split in GOLDEN}
    for split, losses in GOLDEN.items():
        assert got[split] == pytest.approx(losses, rel=1e-6, abs=0), (split, got[split], losses)
