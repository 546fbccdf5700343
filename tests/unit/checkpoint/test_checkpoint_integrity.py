"""Checkpoint integrity and export (``checkpoint/files.py``, ``checkpoint/export.py``).

One 4-rank spawn saves two checkpoints of the tiny GPT-MoE (``test_checkpoint``'s model, dropless
routing): tp2 x ep2 under ZeRO-1 (a ``GPTModel``, untied) and pp2 x ep2 under ZeRO-1 on DeepSpeed's
PipelineEngine (tied word embedding and output layer), then, into the running tp2 x ep2 model:

* damaged copies: 8 KB of zeros inside an expert file and the optimizer file, a flipped byte in
  DeepSpeed's model file and an rng file, truncated model and rng files, a truncated metadata
  file (bad JSON), ``latest`` naming a missing tag (loaded strictly; else the tag that is there
  loads): each a ``CheckpointError`` naming the file, what was recorded and what was found, on
  every rank, with no weight changed (no other tag to fall back to); a checkpoint
  without checksums (older saves) whose rng file is truncated names that file too;
* the example's ``load_checkpoint`` (``--load``): a missing or empty directory (or one holding only
  what a killed first save left) starts from scratch with a log line; a directory with a tag but no
  ``latest`` is an error naming the path;
* in this process, a tag whose metadata records format version 1 or 2 (never released) or 4: ``moe-plugin
  export`` and ``export-hf`` refuse it in one line naming the file and both versions.

In the parent, both checkpoints are exported (``export_checkpoint``; the CLI's ``moe-plugin export``
for one) and a 1-rank spawn loads each export into a ``GPTModel`` built from its ``config.json``
with ``gpt_moe_spec``: the evaluation loss equals the parallel model's (rtol 1e-5).

A save killed by ``os._exit`` (no clean-up at all, as kill -9) while writing: two 4-rank spawns;
the second loads (the stale ``.tmp-`` directory is removed, ``latest`` is the previous tag) and
resumes with the uninterrupted run's losses, bit for bit. The same through the example on 2 ranks
(``main`` as the launcher runs it), ``--save`` and ``--load`` naming one directory: the first run
starts from scratch with a line saying so and dies saving step 4; the same command again resumes
from step 2 with the uninterrupted run's losses (step 3 exactly, then within rtol 1e-6: the example's
DeepSpeed AdamW is not bit-exact on resume, as in ``test_example``).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher import REPO
from ds_json import ds_config
from tests.unit.checkpoint.test_checkpoint import (
    BATCH,
    MOE,
    VOCAB,
    _engine,
    _entries,
    _eval_loss,
    _micro_batches,
    _pipe_engine,
    _train,
    _weights,
)

DROPLESS = {**{k: v for k, v in MOE.items() if k != "capacity_factor"}, "drop_tokens": False}   # no capacity
TP_EP = {"parallel": {"tensor": 2, "expert": 2}, "stage": 1, "opt": "AdamW"}
STEPS = 3
ROOT = REPO
# name -> (file relative to the tag, damage); the optimizer record is the tag's one optimizer state
DAMAGE = {
    "expert-zeros": ("experts/expert_00001_pp_00.safetensors", "zeros"),
    "optim-zeros": ("optimizer/dense_pp_00_tp_00.safetensors", "zeros"),
    "model-flip": ("mp_rank_01_model_states.pt", "flip"),
    "rng-flip": ("rng/rank_00002.safetensors", "flip"),
    "model-truncated": ("mp_rank_00_model_states.pt", "truncate"),
    "rng-truncated": ("rng/rank_00003.safetensors", "truncate"),
    "meta-bad-json": ("moe_plugin.json", "truncate"),
}


# -- inside the ranks ------------------------------------------------------------------------------
def _damage(tag_dir: str, target: str, how: str) -> str:
    path = os.path.join(tag_dir, target)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "zeros":   # 8 KB of zeros inside the file (all of it past a small header if smaller)
            start = min(size // 4, max(64, size - 8192))
            f.seek(start)
            f.write(bytes(min(8192, size - start)))
        elif how == "flip":
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0xFF]))
        else:
            f.truncate(size // 2)
    return path


def _damaged_copy(root: str, saved: str, name: str, change) -> tuple[str, str]:
    """A copy of checkpoint directory ``saved`` changed by ``change(tag_dir)`` (rank 0); returns
    (copy, what change returned)."""
    from moe_plugin.checkpoint import read_latest

    copy = os.path.join(root, "damaged", name)
    out = [None]
    if torch.distributed.get_rank() == 0:
        shutil.copytree(saved, copy)
        out[0] = change(os.path.join(copy, read_latest(copy)))
    torch.distributed.broadcast_object_list(out, src=0)
    return copy, out[0]


def _refused(run, directory: str, strict: bool = False) -> dict:
    from moe_plugin.checkpoint import CheckpointError, load_checkpoint

    before = _weights(run)
    try:   # not pytest.raises: its failure would leave this rank's collectives out of step with the others'
        load_checkpoint(run, directory, strict=strict)
        error = "no error: the load went through"
    except CheckpointError as failure:
        error = str(failure)
    after = _weights(run)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def _integrity(root: str, run, saved: str) -> dict:
    from moe_plugin.checkpoint import load_checkpoint

    out = {}
    for name, (target, how) in DAMAGE.items():
        directory, path = _damaged_copy(root, saved, name, lambda tag_dir: _damage(tag_dir, target, how))
        out[name] = {**_refused(run, directory), "path": path}

    def latest_to_missing_tag(tag_dir):
        Path(tag_dir).parent.joinpath("latest").write_text("global_step999")
        return os.path.join(Path(tag_dir).parent, "global_step999")

    directory, path = _damaged_copy(root, saved, "latest-missing-tag", latest_to_missing_tag)
    out["latest-missing-tag"] = {**_refused(run, directory, strict=True), "path": path}
    out["latest-missing-tag-fallback"] = load_checkpoint(run, directory)[0]   # not strict: the tag that is there

    def unverified(tag_dir):   # an older save: no checksums; its rng file truncated
        meta = json.loads(Path(tag_dir, "moe_plugin.json").read_text())
        del meta["files"]
        Path(tag_dir, "moe_plugin.json").write_text(json.dumps(meta))
        return _damage(tag_dir, "rng/rank_00001.safetensors", "truncate")

    directory, path = _damaged_copy(root, saved, "unverified-rng-truncated", unverified)
    out["unverified-rng-truncated"] = {**_refused(run, directory), "path": path}
    return out


def _example_load(root: str, run) -> dict:
    """The example's ``load_checkpoint`` (what ``--load`` calls) on missing, empty and tag-only directories."""
    from example_runs import example_script

    from moe_plugin.checkpoint import CheckpointError

    example = example_script()
    out = {}
    empty, tag_only = os.path.join(root, "load-empty"), os.path.join(root, "load-tag-only")
    interrupted = os.path.join(root, "load-interrupted")   # a first save killed midway
    if torch.distributed.get_rank() == 0:
        os.makedirs(empty)
        os.makedirs(os.path.join(tag_only, "step5"))
        os.makedirs(os.path.join(interrupted, ".tmp-step5", "experts"))
        Path(interrupted, "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    torch.distributed.barrier()
    for name, directory in {"missing": os.path.join(root, "load-missing"), "empty": empty,
                            "interrupted": interrupted}.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out[name] = example.load_checkpoint(run, directory)
        out[name + "-log"] = printed.getvalue()
    try:
        example.load_checkpoint(run, tag_only)
        out["tag-only"] = "no error"
    except CheckpointError as failure:
        out["tag-only"] = str(failure)
    return out


def _child(rank: int, world_size: int, root: str) -> dict:
    from dist import attempts
    from moe_plugin.checkpoint import save_checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = {}
    attempt = attempts(results, rank)

    def pipe():
        run = _pipe_engine({"pipeline": 2, "expert": 2}, 1, DROPLESS, tied=True, warmup=False)
        try:
            for step in range(STEPS):
                run.engine.train_batch(_micro_batches(run, step))
            save_checkpoint(run, os.path.join(root, "pp2ep2"))
            return {"eval": run.engine.eval_batch(_micro_batches(run, 999)).item()}
        finally:
            run.close()

    attempt("pp2ep2", pipe)
    run = _engine(TP_EP, DROPLESS)
    try:
        _train(run, range(STEPS))
        save_checkpoint(run, os.path.join(root, "tp2ep2"))
        results["tp2ep2"] = {"eval": _eval_loss(run)}
        attempt("integrity", _integrity, root, run, os.path.join(root, "tp2ep2"))
        attempt("example", _example_load, root, run)
    finally:
        run.close()
    return results


def _one_rank_eval(rank: int, world_size: int, export_dirs: list) -> dict:
    """Each export loaded into a 1-rank GPTModel built from its config.json: the eval loss."""
    import moe_plugin
    from megatron.core.models.gpt import GPTModel

    from moe_plugin.checkpoint.export import exported_transformer_config, load_export
    from moe_plugin.integration.megatron import gpt_moe_spec

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    out = {}
    for directory in export_dirs:
        state, config = load_export(directory)

        def provide(moe_config, groups):
            tc = exported_transformer_config(config)
            return GPTModel(tc, gpt_moe_spec(moe_config, tc, groups), vocab_size=config["vocab_size"],
                            max_sequence_length=config["max_sequence_length"],
                            share_embeddings_and_output_weights=config["share_embeddings_and_output_weights"],
                            position_embedding_type=config["position_embedding_type"], rotary_base=config["rotary_base"])

        cfg = ds_config(batch=BATCH, micro=BATCH, gas=1, zero=None, clip=None, moe=config["moe"],
                        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
        run = moe_plugin.initialize(cfg, provide)
        try:
            missing, unexpected = run.engine.module.load_state_dict(state, strict=False)
            out[directory] = {"missing": [k for k in missing if not k.endswith("_extra_state")],
                              "unexpected": list(unexpected), "eval": _eval_loss(run),
                              "tied": run.engine.module.share_embeddings_and_output_weights}
        finally:
            run.close()
    return out


# -- the checks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("integrity")
    return root, run_distributed(_child, 4, root, str(root / "checkpoints"), timeout=300)


def _case(results, name) -> list:
    from dist import case_results

    return case_results(results[1], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_file_is_named_and_nothing_loads(results, name):
    for rank, r in enumerate(_case(results, "integrity")):
        case = r[name]
        assert case["path"] in case["error"], f"rank {rank}: {case['error']}"
        assert case["unchanged"], f"rank {rank}: weights changed by a refused load"
        if name == "meta-bad-json":
            assert "unreadable JSON" in case["error"], case["error"]
        elif name.endswith("truncated"):
            assert "bytes, the save recorded" in case["error"], case["error"]
        else:
            assert "sha256" in case["error"] and "the save recorded" in case["error"], case["error"]


@pytest.mark.slow
def test_latest_naming_a_missing_tag_is_named(results):
    for r in _case(results, "integrity"):
        case = r["latest-missing-tag"]   # strict; without, the newest tag that verifies loads
        assert f"{case['path']}: missing" in case["error"] and case["unchanged"], case["error"]
        assert os.path.basename(os.path.dirname(r["latest-missing-tag-fallback"])) == "global_step3", r


@pytest.mark.slow
def test_unreadable_file_of_an_unverified_checkpoint_is_named(results):
    for r in _case(results, "integrity"):
        case = r["unverified-rng-truncated"]   # a safetensors file (plain_files)
        assert case["path"] in case["error"] and "not a safetensors file" in case["error"], case["error"]


@pytest.mark.parametrize("version", [1, 2, 4])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path, capsys, version):
    """Versions 1 and 2 (development formats no release wrote) and a newer one: ``moe-plugin export``
    and ``export-hf`` refuse the tag in one line naming its metadata file, its version and the one read,
    before any other file is read."""
    from commands import cli

    tag = tmp_path / "ckpt" / "step4"
    tag.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("step4")
    (tag / "moe_plugin.json").write_text(json.dumps({"format": "moe_plugin.checkpoint", "version": version}))
    why = "a newer moe_plugin wrote it: upgrade" if version > 3 else "a development version wrote it before any release"
    for command in ("export", "export-hf"):
        status, out = cli(capsys, [command, tmp_path / "ckpt", "--out", tmp_path / command])
        lines = out.strip().splitlines()
        assert status == 2 and len(lines) == 1, out
        assert lines[0].startswith(f"error: {tag / 'moe_plugin.json'}: format 'moe_plugin.checkpoint' version "
                                   f"{version}; this moe_plugin reads 'moe_plugin.checkpoint' version 3 ({why}"), out
        assert not (tmp_path / command).exists()


@pytest.mark.slow
def test_example_load_of_missing_or_empty_directory_starts_fresh(results):
    for rank, r in enumerate(_case(results, "example")):
        assert r["missing"] == 0 and r["empty"] == 0 and r["interrupted"] == 0
        if rank == 0:
            assert "no checkpoint there" in r["missing-log"] and "starting from scratch" in r["empty-log"], r
            assert "starting from scratch" in r["interrupted-log"], r
        assert "load-tag-only" in r["tag-only"] and "latest: missing" in r["tag-only"], r["tag-only"]


@pytest.fixture(scope="module")
def exported(results, tmp_path_factory):
    """Both checkpoints exported: tp2 x ep2 by the Python API, pp2 x ep2 by the CLI."""
    root, _ = results
    out = tmp_path_factory.mktemp("exported")
    from moe_plugin.checkpoint.export import export_checkpoint

    lines: list = []
    export_checkpoint(root / "checkpoints" / "tp2ep2", out / "tp2ep2", progress=lines.append)
    cli = subprocess.run([sys.executable, "-m", "moe_plugin_tools.cli", "export", str(root / "checkpoints" / "pp2ep2"),
                          "--out", str(out / "pp2ep2")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert cli.returncode == 0, cli.stderr
    return out, lines, cli.stdout


@pytest.mark.slow
def test_export_round_trip_gives_the_parallel_models_loss(results, exported, tmp_path):
    from dist import run_distributed

    out, lines, cli_output = exported
    assert any("expert files" in line for line in lines) and any("writing" in line for line in lines), lines
    assert "tied embeddings" in cli_output and "model.safetensors" in cli_output, cli_output
    configs = {name: json.loads((out / name / "config.json").read_text()) for name in ("tp2ep2", "pp2ep2")}
    assert configs["tp2ep2"]["share_embeddings_and_output_weights"] is False
    assert configs["pp2ep2"]["share_embeddings_and_output_weights"] is True
    for config in configs.values():
        assert config["transformer_config"]["tensor_model_parallel_size"] == 1
        assert config["moe"]["parallel"]["expert"] == 1 and config["vocab_size"] == VOCAB

    evals = run_distributed(_one_rank_eval, 1, tmp_path, [str(out / "tp2ep2"), str(out / "pp2ep2")], timeout=300)[0]
    for name in ("pp2ep2", "tp2ep2"):
        got = evals[str(out / name)]
        assert got["missing"] == [] and got["unexpected"] == [], got
        parallel = _case(results, name)[0]["eval"]
        torch.testing.assert_close(got["eval"], parallel, rtol=1e-5, atol=0)
    assert evals[str(out / "pp2ep2")]["tied"]


# -- a save killed midway --------------------------------------------------------------------------
def _killed(rank: int, world_size: int, directory: str, losses_file: str) -> None:
    """Steps 0-2, save ``step3``, steps 3-5 (their losses to ``losses_file.RANK``), then a save that
    dies (``os._exit``, no clean-up) on every rank while writing the rng files."""
    from moe_plugin.checkpoint import api as checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    run = _engine(RESUME_CASE)
    _train(run, range(3))
    checkpoint.save_checkpoint(run, directory, tag="step3")
    torch.save(_train(run, range(3, 6)), f"{losses_file}.{rank}")
    torch.distributed.barrier()
    write = checkpoint._write

    def dying(obj, path):
        if os.sep + checkpoint.RNG_DIR + os.sep in path:
            os._exit(9)
        write(obj, path)

    checkpoint._write = dying
    checkpoint.save_checkpoint(run, directory, tag="step6")


def _resumed(rank: int, world_size: int, directory: str) -> dict:
    from moe_plugin.checkpoint import api as checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out = {}
    torch.distributed.barrier()
    run = _engine(RESUME_CASE)
    try:
        checkpoint.load_checkpoint(run, directory)
        out["entries_loaded"] = _entries(directory)
        out["global_steps"] = run.engine.global_steps
        out["resumed"] = _train(run, range(3, 6))
    finally:
        run.close()
    return out


RESUME_CASE = {"parallel": {"expert": 2}, "stage": 1, "opt": "AdamW"}


@pytest.mark.slow
def test_save_killed_midway_resumes_the_uninterrupted_run(tmp_path):
    from dist import run_distributed

    directory, losses_file = str(tmp_path / "ckpt"), str(tmp_path / "losses.pt")
    with pytest.raises(Exception, match="exit|signal|code"):
        run_distributed(_killed, 4, tmp_path, directory, losses_file, timeout=300)
    assert _entries(directory) == [".tmp-step6", "latest", "step3"], _entries(directory)
    results = run_distributed(_resumed, 4, tmp_path, directory, timeout=300)
    for rank, r in enumerate(results):
        uninterrupted = torch.load(f"{losses_file}.{rank}")
        assert r["global_steps"] == 3
        assert r["resumed"] == uninterrupted, (rank, r["resumed"], uninterrupted)
        assert r["entries_loaded"] == ["latest", "step3"], r["entries_loaded"]


# -- the example, --save and --load the same directory, killed while saving -------------------------
def _example_dying(rank: int, world_size: int, argv: list, die_in: str, printed_file: str) -> None:
    """The example's ``main`` whose save of tag ``die_in`` ends every rank with ``os._exit`` while
    writing the rng files (after DeepSpeed's and the expert files); rank 0's output so far goes to
    ``printed_file`` first."""
    from example_runs import example_script

    from moe_plugin.checkpoint import api as checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    printed, write = io.StringIO(), checkpoint._write

    def dying(obj, path):
        if f"{checkpoint.TMP_PREFIX}{die_in}{os.sep}{checkpoint.RNG_DIR}{os.sep}" in path:
            if rank == 0:
                Path(printed_file).write_text(printed.getvalue())
            os._exit(9)
        write(obj, path)

    checkpoint._write = dying
    with contextlib.redirect_stdout(printed):
        example_script().main(argv)


@pytest.mark.slow
def test_example_killed_while_saving_resumes_the_uninterrupted_run(tmp_path):
    from dist import run_distributed
    from example_runs import MODEL_FLAGS, ds_config, run_main

    ckpt = str(tmp_path / "ckpt")

    def argv(name: str, *extra: str) -> list:
        return [*MODEL_FLAGS, "--train-iters", "6", "--deepspeed_config",
                str(ds_config(tmp_path / f"{name}.json", 2, expert=2)), "--run-dir", str(tmp_path / "runs" / name),
                "--data-cache", str(tmp_path / "data"), *extra]

    def train_losses(name: str) -> dict:
        records = (json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in records if r["split"] == "train"}

    assert [r["status"] for r in run_distributed(run_main, 2, tmp_path, argv("whole"), timeout=600)] == [0, 0]
    same_dir = ("--save", ckpt, "--load", ckpt, "--save-interval", "2")   # a first run: nothing to load yet
    with pytest.raises(Exception, match="exit|signal|code"):
        run_distributed(_example_dying, 2, tmp_path, argv("killed", *same_dir), "step4", str(tmp_path / "printed"),
                        timeout=600)
    assert "no checkpoint there (missing or empty directory); starting from scratch" in (
        tmp_path / "printed").read_text()
    assert _entries(ckpt) == [".tmp-step4", "latest", "step2"], _entries(ckpt)
    assert [r["status"] for r in run_distributed(run_main, 2, tmp_path, argv("resumed", *same_dir),
                                                 timeout=600)] == [0, 0]
    whole, resumed = train_losses("whole"), train_losses("resumed")
    assert sorted(resumed) == [3, 4, 5, 6]
    assert resumed[3] == whole[3]   # the weights and batch of step 3 exactly; later steps to fp32 rounding
    assert [resumed[s] for s in range(3, 7)] == pytest.approx([whole[s] for s in range(3, 7)], rel=1e-6, abs=0)
    assert _entries(ckpt) == ["latest", "step2", "step4", "step6"], _entries(ckpt)
