"""Loading never runs code from a file (docs/checkpoints.md, "What a load trusts").

Every kind of file a checkpoint holds gets a planted object whose unpickling would write a marker
file: the expert files, the optimizer record and the rng files (safetensors: replaced by a pickle
holding it), DeepSpeed's module file (the object added to its content), a conversion's dense file,
an export's weights. Each is refused by the readers the user runs -- the example's ``--load``
(``load_checkpoint``) on 2 ranks, ``moe-plugin export``, ``export-hf``, ``upcycle`` -- with one line
naming the file, and the marker is never written. The file's checksum in ``moe_plugin.json`` is
updated first, as whoever planted it would. The same checkpoint unchanged resumes the run's losses.

A tag whose metadata records format version 1 or 2 (never released; their files were pickles of
the plugin's own) is refused by ``--load`` and ``export`` in one line naming the metadata file, its
version and the one read. import-hf refuses ``pytorch_model.bin`` unless trusted, and then imports the
same checkpoint as from safetensors.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from commands import cli
import torch

from dist import run_distributed
from example_runs import MODEL_FLAGS, ds_config, run_main_printing, train_losses

pytestmark = pytest.mark.slow   # the example on 2 ranks, the commands in this process


class Planted:
    """Unpickling it writes ``marker`` (a shell command: what an attacker's object would run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(tag_dir: Path, name: str) -> None:
    """Record ``name``'s new size and sha256 in the tag's metadata, as a tamperer would."""
    meta = json.loads((tag_dir / "moe_plugin.json").read_text())
    data = (tag_dir / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tag_dir / "moe_plugin.json").write_text(json.dumps(meta))


def _plant(source: Path, target: Path, name: str, marker: Path) -> Path:
    """A copy of checkpoint directory ``source`` whose latest tag's file ``name`` carries a
    ``Planted`` object: a ``.pt`` file gets it added to its content, any other file is replaced by
    a pickle holding it. Returns the planted file's path."""
    shutil.copytree(source, target)
    tag_dir = target / (target / "latest").read_text().strip()
    path = tag_dir / name
    if name.endswith(".pt"):
        content = torch.load(path, weights_only=False)
        content["planted"] = Planted(str(marker))
        torch.save(content, path)
    else:
        torch.save({"weights": torch.ones(2), "planted": Planted(str(marker))}, path)
    _rehash(tag_dir, name)
    return path


def _one_error_line(out: str, path: Path) -> str:
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in out, out[-3000:]
    return lines[0]


STEPS = 8
FLAGS = [*MODEL_FLAGS[:MODEL_FLAGS.index("--eval-interval")], "--eval-interval", "0",
         *MODEL_FLAGS[MODEL_FLAGS.index("--eval-interval") + 2:], "--log-interval", "1"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The example's MoE run on 2 ranks (ep 2, ZeRO-1) saving at steps 4 and 8, its dense run on 1
    rank, a tiny Mixtral imported with import-hf."""
    from hf_tiny import EXPERTS, save_tiny_model
    from moe_plugin.interop import import_hf

    root = tmp_path_factory.mktemp("safe")
    config = ds_config(root / "ds.json", 2, expert=2)
    argv = [*FLAGS, "--deepspeed_config", str(config), "--data-cache", str(root / "data"), "--no-plot"]
    results = run_distributed(run_main_printing, 2, root, [*argv, "--run-dir", str(root / "runs" / "full"),
                                                          "--save", str(root / "ckpt"), "--save-interval", "4"],
                              timeout=300)
    assert [r["status"] for r in results] == [0, 0], results[0]["out"][-2000:]
    step4 = root / "ckpt4"   # the step-4 tag alone: the resume point
    shutil.copytree(root / "ckpt", step4, ignore=shutil.ignore_patterns("step8"))
    (step4 / "latest").write_text("step4")
    dense_config = ds_config(root / "dense.json", 1)
    dense = run_distributed(run_main_printing, 1, root, [*FLAGS, "--dense", "--deepspeed_config", str(dense_config),
                                                        "--data-cache", str(root / "data"), "--no-plot", "--run-dir",
                                                        str(root / "runs" / "dense"), "--save", str(root / "dense"),
                                                        "--train-iters", "2"], timeout=300)
    assert dense[0]["status"] == 0, dense[0]["out"][-2000:]
    hf = save_tiny_model("mixtral", str(root / "mixtral"))
    import_hf(hf, {"moe": {"num_experts": EXPERTS}}, root / "hf_ckpt", progress=lambda line: None)
    return {"root": root, "argv": argv, "config": config, "ckpt": step4, "dense": root / "dense",
            "hf": Path(hf), "hf_ckpt": root / "hf_ckpt", "losses": train_losses(root / "runs" / "full")}


def _resume(made, load_dir: Path, name: str, *extra: str) -> tuple[list[dict], dict]:
    run_dir = made["root"] / "runs" / name
    results = run_distributed(run_main_printing, 2, made["root"], [*made["argv"], "--run-dir", str(run_dir),
                                                                   "--load", str(load_dir), *extra], timeout=300)
    return results, (train_losses(run_dir) if all(r["status"] == 0 for r in results) else {})


# the files a load of the example's checkpoint reads, one of each kind
TRAINING_FILES = {"expert": "experts/expert_00001_pp_00.safetensors",
                  "record": "optimizer/dense_pp_00_tp_00.safetensors",
                  "rng": "rng/rank_00001.safetensors",
                  "deepspeed-module": "mp_rank_00_model_states.pt"}


@pytest.mark.parametrize("kind", list(TRAINING_FILES))
def test_example_load_refuses_a_planted_object(made, tmp_path, kind):
    marker = tmp_path / "marker"
    planted = _plant(made["ckpt"], tmp_path / "ckpt", TRAINING_FILES[kind], marker)
    results, _ = _resume(made, tmp_path / "ckpt", f"planted-{kind}")
    assert [r["status"] for r in results] == [1, 1], results[0]["out"][-2000:]   # the example's status for a bad file
    _one_error_line(results[0]["out"], planted)
    assert not marker.exists()


def test_the_same_checkpoint_unchanged_resumes_the_run(made):
    results, losses = _resume(made, made["ckpt"], "resumed")
    assert [r["status"] for r in results] == [0, 0], results[0]["out"][-2000:]
    assert {s: losses[s] for s in range(5, STEPS + 1)} == {s: made["losses"][s] for s in range(5, STEPS + 1)}


# (what is planted, command) -> the file, in which checkpoint
COMMANDS = {
    "export-expert": ("ckpt", "experts/expert_00000_pp_00.safetensors", "export"),
    "export-record": ("ckpt", "optimizer/dense_pp_00_tp_00.safetensors", "export"),
    "export-deepspeed-module": ("ckpt", "mp_rank_00_model_states.pt", "export"),
    "export-hf-expert": ("hf_ckpt", "experts/expert_00003_pp_00.safetensors", "export-hf"),
    "export-hf-dense": ("hf_ckpt", "model/dense_pp_00_tp_00.safetensors", "export-hf"),
    "export-hf-deepspeed-module": ("hf_ckpt", "mp_rank_00_model_states.pt", "export-hf"),
    "upcycle-record": ("dense", "optimizer/dense_pp_00_tp_00.safetensors", "upcycle"),
    "upcycle-deepspeed-module": ("dense", "mp_rank_00_model_states.pt", "upcycle"),
}


@pytest.mark.parametrize("case", list(COMMANDS))
def test_commands_refuse_a_planted_object(made, tmp_path, capsys, case):
    source, name, command = COMMANDS[case]
    marker = tmp_path / "marker"
    planted = _plant(made[source], tmp_path / "ckpt", name, marker)
    argv = [command, tmp_path / "ckpt", "--out", tmp_path / "out"]
    if command == "upcycle":
        argv += ["--config", made["config"]]
    status, out = cli(capsys, argv)
    assert status == 2, out[-2000:]
    _one_error_line(out, planted)
    assert not marker.exists() and not (tmp_path / "out" / "latest").exists()


def test_an_export_with_planted_weights_is_refused(made, tmp_path, capsys):
    from moe_plugin.checkpoint import CheckpointError, load_export

    assert cli(capsys, ["export", made["ckpt"], "--out", tmp_path / "export"])[0] == 0
    state, _config = load_export(tmp_path / "export")
    marker = tmp_path / "marker"
    torch.save({"planted": Planted(str(marker))}, tmp_path / "export" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'export' / 'model.safetensors'}: not a safetensors"):
        load_export(tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    config["transformer_config"]["activation_func"] = "os:system"   # an import the JSON chooses
    from moe_plugin.checkpoint.export import exported_transformer_config

    with pytest.raises(CheckpointError, match="activation_func 'os:system' names a module outside"):
        exported_transformer_config(config)
    assert not marker.exists() and state


def test_import_hf_refuses_pickled_weights_unless_trusted(made, tmp_path, capsys):
    from moe_plugin.checkpoint.export import CheckpointSource

    from safetensors.torch import load_file

    pickled = tmp_path / "mixtral-bin"   # the same model as pickled weights (save_pretrained's older format)
    shutil.copytree(made["hf"], pickled, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(load_file(made["hf"] / "model.safetensors"), pickled / "pytorch_model.bin")
    assert (pickled / "pytorch_model.bin").exists() and not (pickled / "model.safetensors").exists()
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "moe": {"num_experts": 8}}))
    status, out = cli(capsys, ["import-hf", pickled, "--config", config, "--out", tmp_path / "ckpt"])
    assert status == 2 and "pickled weights" in _one_error_line(out, pickled / "pytorch_model.bin")
    assert not (tmp_path / "ckpt").exists()
    status, out = cli(capsys, ["import-hf", pickled, "--config", config, "--out", tmp_path / "ckpt",
                                    "--trust-checkpoint"])
    assert status == 0, out
    ours, theirs = CheckpointSource(tmp_path / "ckpt"), CheckpointSource(made["hf_ckpt"])
    assert sorted(ours.specs()) == sorted(theirs.specs())
    for key in ours.specs():
        assert torch.equal(ours.read(key), theirs.read(key)), key


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_an_unreleased_version_is_refused(made, tmp_path, capsys, version):
    old = tmp_path / "old"
    shutil.copytree(made["ckpt"], old)
    meta_file = old / "step4" / "moe_plugin.json"
    meta = json.loads(meta_file.read_text())
    meta["version"] = version
    meta_file.write_text(json.dumps(meta))
    expected = (f"{meta_file}: format 'moe_plugin.checkpoint' version {version}; this moe_plugin reads "
                "'moe_plugin.checkpoint' version 3 (a development version wrote it before any release")
    results, _ = _resume(made, old, f"version-{version}")
    assert [r["status"] for r in results] == [1, 1], results[0]["out"][-2000:]
    assert expected in _one_error_line(results[0]["out"], meta_file)
    status, out = cli(capsys, ["export", old, "--out", tmp_path / "export"])
    assert status == 2 and expected in _one_error_line(out, meta_file)
