"""Loading never runs code from a file (docs/checkpoints.md, "What a load trusts").

Every kind of file a checkpoint holds gets a planted object whose unpickling would write a marker
file: the expert files, the optimizer record and the rng files (safetensors: replaced by a pickle
holding it), DeepSpeed's module file (the object added to its content), a conversion's dense file,
an export's weights. Each is refused by the readers the user runs -- the example's ``--load``
(``load_checkpoint``) on 2 ranks, ``moe-plugin export``, ``export-hf``, ``upcycle`` -- with one line
naming the file, and the marker is never written. The file's checksum in ``moe_plugin.json`` is
updated first, as whoever planted it would. The same checkpoint unchanged resumes the run's losses.

Checkpoints of an earlier moe_plugin (format 2: pickles of its own; made here from a new one by
writing its rng and record files back as ``torch.save`` pickles, as that version did): refused in one
line naming a legacy pickle and ``convert-checkpoint``; loaded with ``--trust-checkpoint``; converted,
loaded without it; both resume the same losses. import-hf refuses ``pytorch_model.bin`` unless
trusted, and then imports the same checkpoint as from safetensors.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
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


def _as_version_2(source: Path, target: Path) -> None:
    """``source`` (format 3) as the format-2 checkpoint an earlier moe_plugin wrote: its rng files
    and optimizer record as ``torch.save`` pickles of the same content."""
    from moe_plugin.checkpoint.plain_files import read_plain

    shutil.copytree(source, target)
    tag_dir = target / (target / "latest").read_text().strip()
    meta = json.loads((tag_dir / "moe_plugin.json").read_text())
    for name in [n for n in meta["files"] if n.startswith(("rng/", "optimizer/"))]:
        kind = "rng" if name.startswith("rng/") else "optimizer_record"
        content = read_plain(str(tag_dir / name), kind)
        if kind == "rng" and content.get("numpy") is not None:   # NumPy's own tuple, as it pickled it
            content["numpy"] = tuple(content["numpy"])
        os.remove(tag_dir / name)
        old = name[:-len(".safetensors")] + ".pt"
        torch.save(content, tag_dir / old)
        del meta["files"][name]
        data = (tag_dir / old).read_bytes()
        meta["files"][old] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["version"] = 2
    (tag_dir / "moe_plugin.json").write_text(json.dumps(meta))


def test_a_legacy_checkpoint_loads_only_trusted_or_converted(made, tmp_path, capsys):
    legacy = tmp_path / "legacy"
    _as_version_2(made["ckpt"], legacy)
    results, _ = _resume(made, legacy, "legacy-refused")
    assert [r["status"] for r in results] == [1, 1]
    line = _one_error_line(results[0]["out"], legacy / "step4" / "optimizer" / "dense_pp_00_tp_00.pt")
    assert "a legacy pickle" in line and "moe-plugin convert-checkpoint" in line and "--trust-checkpoint" in line
    status, out = cli(capsys, ["export", legacy, "--out", tmp_path / "export"])
    assert status == 2 and "a legacy pickle" in out
    expected = {s: made["losses"][s] for s in range(5, STEPS + 1)}
    results, losses = _resume(made, legacy, "legacy-trusted", "--trust-checkpoint")
    assert [r["status"] for r in results] == [0, 0], results[0]["out"][-2000:]
    assert {s: losses[s] for s in expected} == expected
    status, out = cli(capsys, ["convert-checkpoint", legacy, "--out", tmp_path / "converted"])
    assert status == 0 and "pickles rewritten as safetensors" in out, out
    files = json.loads((tmp_path / "converted" / "step4" / "moe_plugin.json").read_text())["files"]
    assert not [n for n in files if n.endswith(".pt") and not n.startswith("mp_rank_")], files
    results, losses = _resume(made, tmp_path / "converted", "converted")
    assert [r["status"] for r in results] == [0, 0], results[0]["out"][-2000:]
    assert {s: losses[s] for s in expected} == expected


def _legacy_tag(root: Path, layers: int) -> Path:
    """A format-2 tag as an earlier moe_plugin wrote it, sized by ``layers``: per layer one dense key
    of the optimizer record (fp32 master and Adam's two moments, 2 M elements each: 24 MB) and one
    format-1 expert file (weights and rows, 24 MB); a rank's rng file. Returns the checkpoint dir."""
    import random

    from moe_plugin.checkpoint.files import file_digest

    tag = root / "ckpt" / "step1"
    for folder in ("rng", "optimizer", "experts"):
        (tag / folder).mkdir(parents=True)
    n = 1 << 21
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": None, "accelerator": None,
                "routers": {}, "megatron_tracker": {}}, tag / "rng" / "rank_00000.pt")
    states = ("fp32", "exp_avg", "exp_avg_sq")
    state = {f"decoder.layers.{i}.mlp.w": {name: torch.full((n,), float(i)) for name in states} for i in range(layers)}
    torch.save({"names": ["exp_avg", "exp_avg_sq", "fp32"], "scalars": {"step": torch.tensor(1.0)}, "state": state,
                "options": [{"lr": 1e-3, "betas": (0.9, 0.95)}], "weights_from_master": {k: "float32" for k in state},
                "weights": {}}, tag / "optimizer" / "dense_pp_00_tp_00.pt")
    del state
    for e in range(layers):
        torch.save({"expert_id": e, "placement": {}, "weights": {"w": torch.full((n,), float(e))},
                    "optimizer": {"w": {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.ones(n)}}},
                   tag / "experts" / f"expert_{e:05d}_pp_00.pt")
    files = {str(p.relative_to(tag)): file_digest(str(p)) for p in sorted(tag.rglob("*")) if p.is_file()}
    (tag / "moe_plugin.json").write_text(json.dumps({"format": "moe_plugin.checkpoint", "version": 2, "tag": "step1",
                                                     "global_steps": 1, "files": files}))
    (root / "ckpt" / "latest").write_text("step1")
    return root / "ckpt"


def test_convert_holds_one_tensor_at_a_time(tmp_path):
    """convert-checkpoint in a child at 2 and 8 layers (96 MB and 384 MB of pickles): its peak RSS must
    not grow with them (one tensor of 8 MB at a time); the converted record and experts read back
    the same values."""
    from moe_plugin.checkpoint.plain_files import read_plain
    from moe_plugin.checkpoint.readers import open_expert_file
    from moe_plugin_tools.bench.hf_model import run_measured

    peaks = {}
    for layers in (2, 8):
        source = _legacy_tag(tmp_path / f"L{layers}", layers)
        done = run_measured([sys.executable, "-m", "moe_plugin_tools.cli", "convert-checkpoint", str(source),
                             "--out", str(tmp_path / f"L{layers}" / "safe")], timeout=300)
        peaks[layers] = done.peak_bytes / 2 ** 20
    print(f"convert-checkpoint peak RSS: {peaks[2]:.0f} MB at 2 layers, {peaks[8]:.0f} MB at 8")
    assert peaks[8] - peaks[2] < 40, peaks   # the pickles grow by 288 MB
    tag = tmp_path / "L8" / "safe" / "step1"
    record = read_plain(str(tag / "optimizer" / "dense_pp_00_tp_00.safetensors"), "optimizer_record")
    assert record["options"] == [{"lr": 1e-3, "betas": (0.9, 0.95)}] and record["scalars"]["step"].item() == 1.0
    assert all(torch.equal(record["state"][f"decoder.layers.{i}.mlp.w"]["exp_avg"], torch.full((1 << 21,), float(i)))
               for i in range(8))
    entry = open_expert_file(str(tag / "experts" / "expert_00007_pp_00.safetensors"))
    assert entry.expert_id == 7 and torch.equal(entry.weights["w"].read(), torch.full((1 << 21,), 7.0))
    meta = json.loads((tag / "moe_plugin.json").read_text())
    assert meta["version"] == 3 and meta["expert_files"] == "safetensors" and meta["converted_from"]["version"] == 2
