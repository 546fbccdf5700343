"""examples/hf_workflow/finetune.py as a user runs it (a subprocess, the venv's bin first on PATH): a tiny
Qwen3-MoE with a chat template built with transformers, ``import-hf``, ``preprocess --chat``, fine-tuning on
4 ranks (ep 2, ``--finetune``, packed conversations) through the deepspeed launcher, ``--skip-train`` on the
held-out chats on 2 ranks, ``export-hf``: transformers' assistant-token loss of the export on the held-out
chats is below the original model's and equals the plugin's validation loss (fp32, 1e-5 relative)."""
from __future__ import annotations

import re
import sys

import pytest

from launcher import REPO, run

SCRIPT = REPO / "examples" / "hf_workflow" / "finetune.py"
LAST = re.compile(r"^fine-tuning: 9/9 steps ran; held-out assistant-token loss (\S+) -> (\S+), plugin (\S+) "
                  r"\(relative difference (\S+)\)$")


@pytest.mark.slow
def test_fine_tuning_lowers_the_held_out_loss_and_transformers_agrees(tmp_path):
    done = run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "work")], cwd=tmp_path, timeout=900,
               split_stderr=True)
    assert done.status == 0, done.tail()
    last = done.output.strip().splitlines()[-1]
    print(last)
    match = LAST.match(last)
    assert match, last
    before, after, plugin, relative = map(float, match.groups())
    assert after < before and relative < 1e-5 and abs(after - plugin) / after < 1e-5, last
    imported = (tmp_path / "work" / "logs" / "import.log").read_text()
    assert "its tokenizer has a chat template" in imported and "docs/fine_tuning.md" in imported
    tuned = (tmp_path / "work" / "logs" / "finetune.log").read_text()
    assert "fine-tuning the weights of" in tuned and "packing efficiency" in tuned
    assert (tmp_path / "work" / "out" / "config.json").is_file()
