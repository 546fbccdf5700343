"""examples/hf_workflow/run.py as a user runs it (a subprocess, the venv's bin first on PATH): the
whole Hugging Face path (tokenizer, tiny Mixtral and Llama, preprocess, import-hf, upcycle, training
on 2 ranks with ep 2 through the deepspeed launcher, export-hf, transformers' generation and logits
against the plugin's) at its smallest: 2 steps, a 96 KiB corpus. Its last line names every step and
the logit agreement; a broken step stops it with status 1, naming the step, and nothing is left in
its work directory's place."""
from __future__ import annotations

import re
import sys

import pytest

from launcher import REPO, Done, run

SCRIPT = REPO / "examples" / "hf_workflow" / "run.py"
LAST = re.compile(r"^workflow: 13/13 steps ran; mixtral logits max\|diff\| (\S+), llama->mixtral (\S+)$")


def _run(tmp_path, *argv: str, env: dict | None = None) -> Done:
    """The script run as a user runs it (stdout in ``output``, stderr apart); past the time limit it
    gets SIGTERM, on which it kills the launchers it started and removes its temporary directory."""
    return run([sys.executable, str(SCRIPT), *argv], cwd=tmp_path, env=env, timeout=900, split_stderr=True)


@pytest.mark.slow
def test_the_workflow_runs_every_step_and_the_logits_agree(tmp_path):
    done = _run(tmp_path, "--train-iters", "2", "--corpus-bytes", str(96 * 1024), "--work", str(tmp_path / "work"))
    assert done.status == 0, done.tail()
    last = done.output.strip().splitlines()[-1]
    print(last)
    match = LAST.match(last)
    assert match, last
    assert all(float(value) < 1e-3 for value in match.groups()), last   # fp32: the same function
    assert "mixtral: transformers generates 'def main(argv):" in done.output
    assert (tmp_path / "work" / "out-llama-mixtral" / "config.json").is_file()


@pytest.mark.slow
def test_a_broken_step_stops_the_workflow_naming_it(tmp_path):
    """The tokenizer step asked for a vocabulary the trainer refuses: status 1, the step named, the
    temporary work directory removed, no later step run."""
    (tmp_path / "tmp").mkdir()
    done = _run(tmp_path, "--vocab-size", "100", env={"TMPDIR": str(tmp_path / "tmp")})   # the script's work directory
    assert done.status == 1, done.output + done.stderr
    assert "workflow: step 2 (train-tokenizer) failed: `moe-plugin train-tokenizer` exited with 2" in done.stderr
    assert "--vocab-size: got 100" in done.stderr
    assert "== step 3" not in done.output
    assert not any((tmp_path / "tmp").iterdir())
