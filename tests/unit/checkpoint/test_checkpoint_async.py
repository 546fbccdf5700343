"""Asynchronous saves (``save_checkpoint(..., async_save=True)``, ``checkpoint/background.py``).

One 4-rank spawn of ``test_checkpoint``'s tiny GPT-MoE (ep 2, ZeRO-1: DeepSpeed writes module,
optimizer-partition files and its recovery scripts):

* the same state saved synchronously and asynchronously, training going on while the writer
  runs: every file of the two tags is the same, byte for byte (the metadata, its checksums
  included);
* the writer fails on one rank (no space left, through ``api._write`` in the writer thread):
  ``poll_save`` raises the same ``CheckpointError`` on every rank at the same step, naming the
  directory; ``latest`` still names the previous tag, which verifies; no ``.tmp-`` directory is left;
* DeepSpeed's checkpoint engine fails on another rank in the writer: ``wait_for_save`` (what a
  run calls before it exits) raises it on every rank; again nothing committed;
* a last asynchronous save commits, and loads;
* the example refuses ``--async-save`` without ``--save``, in one line, before writing anything.

The example through the real ``deepspeed`` launcher (2 ranks, a tiny model, 4 steps, a save every
2): with ``--async-save`` the checkpoint directory holds the same files, byte for byte, as without,
the losses are the same, and the run says when each tag was written in the background.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from example_runs import SCRIPT, TINY, TINY_CPU, example_script, tiny_config, train_losses
from launcher import deepspeed
from tests.unit.checkpoint.test_checkpoint import _engine, _train

CASE = {"parallel": {"expert": 2}, "stage": 1, "opt": "AdamW"}


def _files(tag_dir: str) -> dict[str, bytes]:
    out = {}
    for root, _dirs, names in os.walk(tag_dir):
        for name in names:
            full = os.path.join(root, name)
            out[os.path.relpath(full, tag_dir)] = Path(full).read_bytes()
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _until_committed(run, step: int) -> tuple[int, object]:
    """Train one step at a time, polling after each, until the save in flight is done; returns
    (the step it was reported at, the tag's directory or the error message)."""
    from moe_plugin.checkpoint import CheckpointError, poll_save

    for extra in range(200):
        _train(run, range(step + extra, step + extra + 1))
        try:
            path = poll_save(run)
        except CheckpointError as err:
            return step + extra, str(err)
        if path is not None:
            return step + extra, path
    raise AssertionError("the save was not done after 200 steps")


def _child(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    from moe_plugin.checkpoint import CheckpointError, api, read_latest, save_checkpoint, wait_for_save
    from moe_plugin.checkpoint.background import capturing
    from moe_plugin.checkpoint.files import verify_all
    from moe_plugin.checkpoint.metadata import read_metadata

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    run = _engine(CASE)
    out = {}
    try:
        _train(run, range(2))
        sync = save_checkpoint(run, os.path.join(root, "sync"), tag="s2")
        path = save_checkpoint(run, os.path.join(root, "async"), tag="s2", async_save=True)
        out["before_commit"] = os.path.exists(path) if rank == 0 else None
        step, out["committed"] = _until_committed(run, 2)
        if rank == 0:
            out["same_bytes"] = _files(sync) == _files(path)
            out["names"] = sorted(_files(path))
        dist.barrier()

        # the writer runs out of space on rank 1 (our files)
        real = api._write

        def full_disk(obj, file):
            if capturing() is None and rank == 1:   # in the writer thread
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
            real(obj, file)

        api._write = full_disk
        save_checkpoint(run, os.path.join(root, "async"), tag="s_full", async_save=True)
        out["full_step"], out["full"] = _until_committed(run, step + 1)
        api._write = real
        directory = os.path.join(root, "async")
        out["latest_after_full"] = read_latest(directory)
        out["entries_after_full"] = sorted(e for e in os.listdir(directory) if not e.endswith(".py"))

        # DeepSpeed's checkpoint engine fails on rank 0 (which writes its module file: its optimizer
        # files, which the other ranks would write, are not written), reported by wait_for_save
        engine_save = run.engine.checkpoint_engine.save
        if rank == 0:
            def broken(state_dict, file):
                raise RuntimeError(f"[enforce fail at inline_container.cc] PytorchStreamWriter failed writing {file}")
            run.engine.checkpoint_engine.save = broken
        save_checkpoint(run, directory, tag="s_ds", async_save=True)
        try:
            wait_for_save(run)
            out["ds"] = None
        except CheckpointError as err:
            out["ds"] = str(err)
        run.engine.checkpoint_engine.save = engine_save
        out["latest_after_ds"] = read_latest(directory)
        if rank == 0:
            verify_all(os.path.join(directory, "s2"), read_metadata(directory, "s2"))

        # a last one commits; a load waits for it and takes it
        _train(run, range(step + 3, step + 4))
        save_checkpoint(run, directory, tag="last", async_save=True)
        from moe_plugin.checkpoint import load_checkpoint

        load_checkpoint(run, directory)
        out["latest_at_end"] = read_latest(directory)
        out["entries_at_end"] = sorted(e for e in os.listdir(directory) if not e.endswith(".py"))
    finally:
        run.close()
    return out


@pytest.mark.slow
def test_async_save_writes_the_sync_files_and_reports_writer_failures_on_every_rank(tmp_path, dist_run):
    results = dist_run(_child, 4, str(tmp_path), timeout=300)
    first = results[0]
    assert first["before_commit"] is not None
    assert first["committed"] == str(tmp_path / "async" / "s2")
    assert first["same_bytes"], "the asynchronous save's files differ from the synchronous save's"
    assert "moe_plugin.json" in first["names"] and any(n.startswith("optimizer") for n in first["names"])
    assert not any(n.endswith("optim_states.pt") for n in first["names"])   # the record holds the state, once
    assert any(n.startswith("experts") for n in first["names"]) and any(n.startswith("rng") for n in first["names"])
    assert len({r["full_step"] for r in results}) == 1, results   # every rank, at the same step
    message = results[1]["full"]   # the failing rank's own words; the others add its rank (errors.agree)
    assert [r["full"] for r in results] == [message.replace("(", "(rank 1: ", 1) if rank != 1 else message
                                            for rank in range(4)], results
    assert message.startswith(f"{tmp_path / 'async'}: saving tag 's_full' failed, nothing was committed ("), message
    assert "No space left on device" in message and "'latest' still names 's2', as before" in message
    assert message.endswith("free space there or save elsewhere, then resume"), message
    for r in results:
        assert r["latest_after_full"] == "s2" and r["entries_after_full"] == ["latest", "s2"], r
        assert r["ds"] is not None and r["ds"].replace("rank 0: ", "") == results[0]["ds"]
        assert r["latest_after_ds"] == "s2"
        assert r["latest_at_end"] == "last" and r["entries_at_end"] == ["last", "latest", "s2"], r
    assert "saving tag 's_ds' failed, nothing was committed (rank 0: RuntimeError: [enforce fail" in results[1]["ds"]


@pytest.mark.slow
def test_example_async_save_writes_what_a_sync_save_writes(tmp_path, launcher_port):
    from moe_plugin.checkpoint.plain_files import read_plain

    def launch(name: str, *flags: str) -> str:
        done = deepspeed("--num_gpus", "2", "--master_port", str(launcher_port), str(SCRIPT), "--deepspeed_config",
                         str(tiny_config(tmp_path)), *TINY, "--train-iters", "4", "--save-interval", "2", "--no-plot",
                         "--run-dir", str(tmp_path / name), "--data-cache", str(tmp_path / "data"),
                         "--save", str(tmp_path / f"{name}-ckpt"), *flags, cwd=tmp_path, timeout=300)
        assert done.status == 0, done.tail()
        return done.output

    sync = launch("sync")
    out = launch("async", "--async-save")
    assert "saved checkpoint step2 to " in sync and "being written to" not in sync
    for step in (2, 4):
        assert f"checkpoint step{step}: copied in " in out and f"checkpoint step{step} written to " in out, out[-3000:]
    assert train_losses(tmp_path / "async") == train_losses(tmp_path / "sync")
    files = {name: _files(str(tmp_path / f"{name}-ckpt")) for name in ("sync", "async")}
    assert sorted(files["async"]) == sorted(files["sync"]) and "step4/moe_plugin.json" in files["sync"]
    differ = [f for f in files["sync"] if files["sync"][f] != files["async"][f]]
    # Two runs differ in Python's and NumPy's random streams (the example seeds neither), which the rng
    # files hold, and so in those files' checksums: the rest of them must be equal
    assert all(f.endswith("moe_plugin.json") or "/rng/" in f for f in differ), differ
    for f in differ:
        if f.endswith("moe_plugin.json"):
            sync, other = (json.loads(files[k][f]) for k in ("sync", "async"))
            for meta in (sync, other):
                meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("rng/")}
            assert sync == other, f
        else:
            sync, other = (read_plain(str(tmp_path / f"{k}-ckpt" / f), "rng") for k in ("sync", "async"))
            assert sorted(sync) == sorted(other) and all(
                _same(sync[k], other[k]) for k in sync if k not in ("python", "numpy")), f


def test_example_refuses_async_save_without_save_before_writing_anything(tmp_path, capsys):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    status = example_script().main(["--deepspeed_config", str(TINY_CPU), "--run-dir", str(run_dir), "--data-cache",
                                    str(data), "--async-save"])
    out = capsys.readouterr()
    assert status == 2
    assert [x for x in (out.out + out.err).splitlines() if x.startswith("error: ")] == [
        "error: --async-save: got True; writes the checkpoints of --save in the background, which is not given: "
        "pass --save DIR too"]
    assert not run_dir.exists() and not data.exists()
