"""examples/hf_workflow/run.py as a user runs it (a subprocess, the venv's bin first on PATH): the
whole Hugging Face path (tokenizer, tiny Mixtral and Llama, preprocess, import-hf, upcycle, training
on 2 ranks with ep 2 through the deepspeed launcher, export-hf, transformers' generation and logits
against the plugin's) at its smallest: 2 steps, a 96 KiB corpus. Its last line names every step and
the logit agreement; a broken step stops it with status 1, naming the step, and nothing is left in
its work directory's place."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launcher import REPO, launcher_env

SCRIPT = REPO / "examples" / "hf_workflow" / "run.py"
LAST = re.compile(r"^workflow: 13/13 steps ran; mixtral logits max\|diff\| (\S+), llama->mixtral (\S+)$")


def _run(tmp_path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The script run as a user runs it; past the time limit it gets SIGTERM, on which it kills the
    launchers it started and removes its temporary directory."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *argv], cwd=tmp_path, env=env or launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"the workflow ran past 900 s:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_the_workflow_runs_every_step_and_the_logits_agree(tmp_path):
    done = _run(tmp_path, "--train-iters", "2", "--corpus-bytes", str(96 * 1024), "--work", str(tmp_path / "work"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    print(last)
    match = LAST.match(last)
    assert match, last
    assert all(float(value) < 1e-3 for value in match.groups()), last   # fp32: the same function
    assert "mixtral: transformers generates 'def main(argv):" in done.stdout
    assert (tmp_path / "work" / "out-llama-mixtral" / "config.json").is_file()


@pytest.mark.slow
def test_a_broken_step_stops_the_workflow_naming_it(tmp_path):
    """The tokenizer step asked for a vocabulary the trainer refuses: status 1, the step named, the
    temporary work directory removed, no later step run."""
    env = {**launcher_env(), "TMPDIR": str(tmp_path / "tmp")}   # where the script's temporary work directory goes
    (tmp_path / "tmp").mkdir()
    done = _run(tmp_path, "--vocab-size", "100", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "workflow: step 2 (train-tokenizer) failed: `moe-plugin train-tokenizer` exited with 2" in done.stderr
    assert "--vocab-size: got 100" in done.stderr
    assert "== step 3" not in done.stdout
    assert not any((tmp_path / "tmp").iterdir())
