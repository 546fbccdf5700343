"""A damaged ``latest`` falls back, ``--keep-last`` keeps a few, a full disk fails one clear way
(``checkpoint/tags.py``), through the example on 2 ranks (dp 2, ep 2) as the launcher runs it:

* 8 steps with ``--save-interval 2 --keep-last 2``: four saves leave ``step6`` and ``step8``; these
  are also the uninterrupted run's losses;
* a byte flipped in an expert file of ``step8`` (``latest``), then in one spawn:
  ``--load --strict-load`` exits 1 with the damage error naming the file (as every load did before);
  ``--load`` says in one line on rank 0 that ``step8`` fails verification, naming the file, resumes
  from ``step6``, and steps 7 and 8 give the uninterrupted run's losses (step 7 exactly, then to
  fp32 rounding, as in ``test_checkpoint_integrity``); the same resume saving every step into another
  directory whose writer raises ``OSError(ENOSPC)`` on rank 1 while saving ``step8`` exits 1 with one
  line naming that directory, which holds ``latest`` -> ``step7``, intact (it verifies), and no
  ``.tmp-`` left.

Without a process group: the candidates' order is the step each tag's metadata records (not names,
not file times); ``prune`` keeps the newest N, ``latest``'s tag and the tag just written, leaves
directories that are not tags, and removes nothing when the tag just written is incomplete;
``keep_last`` below 1 is refused before anything is written (API and ``--keep-last``).
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
from pathlib import Path

import pytest

from example_runs import MODEL_FLAGS, ds_config, example_script, train

DAMAGED = os.path.join("experts", "expert_00001_pp_00.safetensors")


def _entries(directory: Path) -> list[str]:
    """What a checkpoint directory holds but DeepSpeed's recovery scripts (zero_to_fp32.py, ...)."""
    return sorted(e for e in os.listdir(directory) if not e.endswith(".py"))


# -- without a process group ---------------------------------------------------------------------------
def _fake_tag(root: Path, tag: str, step: int, mtime: float) -> None:
    from moe_plugin.checkpoint.metadata import FORMAT, FORMAT_VERSION, META_FILE

    (root / tag).mkdir(parents=True)
    (root / tag / "a.pt").write_bytes(b"abc")
    (root / tag / META_FILE).write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "global_steps": step,
                                                    "files": {"a.pt": {"bytes": 3, "sha256": "-"}}}))
    os.utime(root / tag, (mtime, mtime))


def _tags(root: Path) -> dict:
    for tag, step, mtime in (("step10", 10, 1.0), ("step9", 9, 2.0), ("step8", 8, 3.0), ("step2", 2, 4.0)):
        _fake_tag(root, tag, step, mtime)
    (root / "notes").mkdir()    # not a tag: no metadata
    (root / "latest").write_text("step2")   # e.g. step9 and step10 saved with save_latest=False
    from moe_plugin.checkpoint.tags import tag_steps

    return tag_steps(str(root))


def test_newest_is_the_recorded_step(tmp_path):
    from moe_plugin.checkpoint.tags import newest_first

    steps = _tags(tmp_path)
    assert steps == {"step10": 10, "step9": 9, "step8": 8, "step2": 2}
    assert newest_first(steps) == ["step10", "step9", "step8", "step2"]   # not by name, not by time


def test_prune_keeps_the_newest_latest_and_the_tag_written(tmp_path):
    from moe_plugin.checkpoint.tags import prune

    _tags(tmp_path)
    assert prune(str(tmp_path), 2, "step9") == ["step8"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes", "step10", "step2", "step9"]
    assert prune(str(tmp_path), 1, "step9") == []   # beyond the newest: the tag just written and latest's
    assert prune(str(tmp_path), 1, "step10") == ["step9"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes", "step10", "step2"]


def test_prune_removes_nothing_when_the_tag_written_is_incomplete(tmp_path):
    from moe_plugin.checkpoint.tags import prune

    _tags(tmp_path)
    (tmp_path / "step10" / "a.pt").write_bytes(b"ab")
    assert prune(str(tmp_path), 1, "step10") == []
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes", "step10", "step2", "step8", "step9"]


def test_keep_last_below_one_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from moe_plugin.checkpoint import CheckpointError, save_checkpoint

    with pytest.raises(CheckpointError, match=r"^keep_last: got 0; expected an integer >= 1"):
        save_checkpoint(object(), tmp_path / "ckpt", keep_last=0)
    assert not (tmp_path / "ckpt").exists()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ds_config(tmp_path / "ds.json", 2, expert=2)
    status = example_script().main([*MODEL_FLAGS, "--deepspeed_config", "ds.json", "--save", "ckpt",
                                    "--keep-last", "0"])
    err = capsys.readouterr().err
    assert status == 2 and re.search(r"^error: --keep-last: got 0; expected an integer >= 1", err, re.MULTILINE), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]   # no ckpt/, runs/, data/


# -- through the example ------------------------------------------------------------------------------
def _mains(rank: int, world_size: int, runs: list) -> list[dict]:
    """The example's ``main`` once per ``(argv, full_disk_tag)``, rank by rank's stderr captured; with
    ``full_disk_tag``, every write of ours into ``.tmp-<tag>`` raises ENOSPC on rank 1."""
    from moe_plugin.checkpoint import api as checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out, write = [], checkpoint._write
    for argv, full_disk_tag in runs:
        def full(obj, path, tag=full_disk_tag):
            if rank == 1 and f"{checkpoint.TMP_PREFIX}{tag}{os.sep}" in path:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            write(obj, path)

        checkpoint._write = full if full_disk_tag else write
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                status = example_script().main(argv)
        finally:
            checkpoint._write = write
        out.append({"status": status, "stderr": err.getvalue()})
    return out


@pytest.mark.slow
def test_damaged_latest_falls_back_and_keep_last_keeps_two(tmp_path):
    from dist import run_distributed

    from moe_plugin.checkpoint.files import verify_all
    from moe_plugin.checkpoint.metadata import read_latest, read_metadata

    ckpt, full_disk = tmp_path / "ckpt", tmp_path / "full"
    whole = train(tmp_path, "whole", 2, "--save", str(ckpt), "--save-interval", "2", "--keep-last", "2", expert=2)
    assert _entries(ckpt) == ["latest", "step6", "step8"]   # 4 saves, 2 kept
    whole = {r["step"]: r["loss"] for r in whole if r["split"] == "train"}

    damaged = ckpt / "step8" / DAMAGED
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))

    def argv(name: str, *extra: str) -> list:
        return [*MODEL_FLAGS, "--deepspeed_config", str(ds_config(tmp_path / f"{name}.json", 2, expert=2)),
                "--run-dir", str(tmp_path / "runs" / name), "--data-cache", str(tmp_path / "data"),
                "--load", str(ckpt), *extra]

    runs = [(argv("strict", "--strict-load"), None), (argv("resumed"), None),
            (argv("full", "--save", str(full_disk), "--save-interval", "1"), "step8")]
    strict, resumed, full = zip(*run_distributed(_mains, 2, tmp_path, runs, timeout=600))

    # --strict-load: the error every load gave before, one line on rank 0, status 1 on both ranks
    assert [r["status"] for r in strict] == [1, 1]
    errors = [line for line in strict[0]["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"checkpoint {ckpt / 'step8'} is damaged: {damaged}: sha256" in errors[0], errors
    assert "fails verification" not in strict[0]["stderr"]

    # --load: one line on rank 0 naming the tag and the file, then step 6's checkpoint
    assert [r["status"] for r in resumed] == [0, 0]
    said = [line for line in resumed[0]["stderr"].splitlines() if "fails verification" in line]
    assert len(said) == 1, resumed[0]["stderr"]
    # the rank whose share of the files held the damaged one is named when it is not rank 0
    assert re.match(re.escape(f"{ckpt}: the latest tag 'step8' fails verification (") + r"(rank \d+: )?"
                    + re.escape(f"checkpoint {ckpt / 'step8'} is damaged: {damaged}: sha256 "), said[0]), said
    assert said[0].endswith("; loading 'step6', the newest tag that verifies"), said
    assert "fails verification" not in resumed[1]["stderr"]
    records = (json.loads(line) for line in (tmp_path / "runs" / "resumed" / "metrics.jsonl").read_text().splitlines())
    losses = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
    assert sorted(losses) == [7, 8]
    assert losses[7] == whole[7]   # step 6's weights and optimizer state, step 7's batch
    assert [losses[7], losses[8]] == pytest.approx([whole[7], whole[8]], rel=1e-6, abs=0)

    # no space left while saving step 8 (on rank 1): one line naming the directory; step 7 stays latest
    assert [r["status"] for r in full] == [1, 1]
    errors = [line for line in full[0]["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, full[0]["stderr"]
    assert errors[0].startswith(f"error: {full_disk}: saving tag 'step8' failed, nothing was committed (rank 1: "
                                f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"), errors
    assert errors[0].endswith("'latest' still names 'step7', as before; free space there or save elsewhere, then "
                              "resume"), errors
    assert _entries(full_disk) == ["latest", "step7"] and read_latest(full_disk) == "step7"
    verify_all(str(full_disk / "step7"), read_metadata(full_disk, "step7"))   # intact
