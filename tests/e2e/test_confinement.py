"""Files from elsewhere stay inside their directory, and a save never writes through a link
(issue 42, item 1; docs/checkpoints.md, "What a load trusts"), through what a user runs.

Every case is a tampered copy beside a sentinel directory ``outside/`` (a secret file and copies of
the files a path that escaped would find: a tag, its module, dense and expert files, HF weights and
config). On a tiny imported Mixtral, through ``moe-plugin export`` and ``export-hf``: each path field
of ``moe_plugin.json`` (``files`` with the secret's true digest, ``model_files``, ``dense_files``,
``hf.tokenizer_files``) naming an absolute path or ``../``; a tokenizer file or an expert file that is
a link out; an expert file with a second hard link outside; a tag that is a link; ``latest`` a link
out. Through ``import-hf``: shards that the index places outside (absolute, ``../``, a link), a
linked ``config.json`` or ``tokenizer.json``, hard-linked weights; through ``preprocess``: a linked
``tokenizer.json``. Each: status 2, one ``error:`` line naming the file, no traceback, nothing opened
under ``outside/`` (an audit hook sees every Python ``open``), ``outside/`` and the input unchanged, no
output written. The secret's digest is printed nowhere.

Through the example on 2 ranks (slow): ``--load`` of three such copies and of two whose files were
rewritten with their checksums (an expert file in fp16, which a load would cast; a transposed router
weight): status 1 on both ranks, the line from rank 0; saves into a directory with a link planted at ``.tmp-step1`` or ``latest.part``,
and one whose disk is full during DeepSpeed's own writes (its checkpoint engine's ``save`` and its
recovery-script copy raise ENOSPC on rank 0, after writing a few bytes): one line from rank 0,
status 1, nothing written outside, nothing committed, no ``.tmp-`` left.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from commands import cli, snapshot

from example_runs import MODEL_FLAGS, ds_config, example_script

SECRET = b"the secret outside the checkpoint\n"
TAG = "step0"   # the imported checkpoint's tag
EXPERT = "experts/expert_00001_pp_00.safetensors"
_OPENED: list = []       # what Python opened while _watching is set (the audit hook's record)
_WATCHING: list = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCHING and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


@contextlib.contextmanager
def _watching(outside: Path):
    """Inside: every Python ``open`` of a path under ``outside`` is recorded; yields the list."""
    if not getattr(sys, "_moe_plugin_confinement_hook", False):
        sys.addaudithook(_audit)
        sys._moe_plugin_confinement_hook = True
    _OPENED.clear()
    _WATCHING.append(True)
    found: list = []
    try:
        yield found
    finally:
        _WATCHING.clear()
        root = os.path.realpath(outside) + os.sep
        found.extend(p for p in _OPENED if p.startswith(root))


def _digest(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _edit_meta(tag_dir: Path, change) -> None:
    meta = json.loads((tag_dir / "moe_plugin.json").read_text())
    change(meta)
    (tag_dir / "moe_plugin.json").write_text(json.dumps(meta))


def _replace(path: Path, how: str, target: Path) -> None:
    """``path`` becomes a symbolic or hard link to ``target``."""
    path.unlink()
    (path.symlink_to if how == "symlink" else path.hardlink_to)(target)


def _one_error_line(out: str, named: Path) -> str:
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(named) in lines[0] and "Traceback" not in out, out[-3000:]
    return lines[0]


# -- the tampered copies -----------------------------------------------------------------------------
def _box(tmp_path: Path, source: Path, tag: str) -> tuple[Path, Path, Path]:
    """``tmp_path/ckpt`` (a copy of ``source``), its tag directory and the sentinel ``tmp_path/outside``:
    the secret, a copy of the tag, and of its module, dense and expert files."""
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    shutil.copytree(source, ckpt)
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    shutil.copytree(ckpt / tag, outside / tag)
    for name in ("mp_rank_00_model_states.pt", "model/dense_pp_00_tp_00.safetensors", EXPERT):
        if (ckpt / tag / name).exists():
            shutil.copyfile(ckpt / tag / name, outside / os.path.basename(name))
    return ckpt, ckpt / tag, outside


def _files_absolute(ckpt, tag_dir, outside):   # with the secret's true digest, as a tamperer records it
    _edit_meta(tag_dir, lambda m: m["files"].update({str(outside / "secret.txt"): _digest(outside / "secret.txt")}))
    return tag_dir / "moe_plugin.json"


def _files_dotdot(ckpt, tag_dir, outside):
    _edit_meta(tag_dir, lambda m: m["files"].update({"../../outside/secret.txt": _digest(outside / "secret.txt")}))
    return tag_dir / "moe_plugin.json"


def _model_files_absolute(ckpt, tag_dir, outside):
    _edit_meta(tag_dir, lambda m: m["model_files"].update({"0": [str(outside / "mp_rank_00_model_states.pt")]}))
    return tag_dir / "moe_plugin.json"


def _dense_files_dotdot(ckpt, tag_dir, outside):
    _edit_meta(tag_dir, lambda m: m["dense_files"].update({"0": ["../../outside/dense_pp_00_tp_00.safetensors"]}))
    return tag_dir / "moe_plugin.json"


def _tokenizer_absolute(ckpt, tag_dir, outside):
    _edit_meta(tag_dir, lambda m: m["hf"]["tokenizer_files"].append(str(outside / "secret.txt")))
    return tag_dir / "moe_plugin.json"


def _tokenizer_dotdot(ckpt, tag_dir, outside):
    _edit_meta(tag_dir, lambda m: m["hf"]["tokenizer_files"].append("../../../outside/secret.txt"))
    return tag_dir / "moe_plugin.json"


def _tokenizer_link(ckpt, tag_dir, outside):
    _replace(tag_dir / "hf" / "tokenizer.json", "symlink", outside / "secret.txt")
    _edit_meta(tag_dir, lambda m: m["files"].update({"hf/tokenizer.json": _digest(outside / "secret.txt")}))
    return tag_dir / "hf" / "tokenizer.json"


def _expert_link(ckpt, tag_dir, outside):   # the same bytes: its checksum still matches
    _replace(tag_dir / EXPERT, "symlink", outside / os.path.basename(EXPERT))
    return tag_dir / EXPERT


def _expert_hard_link(ckpt, tag_dir, outside):
    _replace(tag_dir / EXPERT, "hardlink", outside / os.path.basename(EXPERT))
    return tag_dir / EXPERT


def _tag_link(ckpt, tag_dir, outside):
    shutil.rmtree(tag_dir)
    tag_dir.symlink_to(outside / tag_dir.name)
    return tag_dir


def _latest_link(ckpt, tag_dir, outside):
    (outside / "latest").write_text(tag_dir.name)
    _replace(ckpt / "latest", "symlink", outside / "latest")
    return ckpt / "latest"


TAMPERED = {f.__name__[1:]: f for f in (_files_absolute, _files_dotdot, _model_files_absolute, _dense_files_dotdot,
                                        _tokenizer_absolute, _tokenizer_dotdot, _tokenizer_link, _expert_link,
                                        _expert_hard_link, _tag_link, _latest_link)}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny Mixtral (with its tokenizer) and its import-hf checkpoint."""
    from hf_tiny import import_tiny

    return import_tiny(tmp_path_factory.mktemp("imported"))


def _check_refused(capsys, tmp_path, argv, named, inputs, outside) -> None:
    """``argv`` refused: status 2, one line naming ``named``, nothing opened or changed outside, the
    inputs unchanged, no ``tmp_path/out``."""
    before, sentinel = snapshot(inputs), snapshot(outside)
    with _watching(outside) as opened:
        status, out = cli(capsys, argv)
    assert status == 2, out[-3000:]
    _one_error_line(out, named)
    assert not opened, opened
    assert snapshot(outside) == sentinel and snapshot(inputs) == before
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    assert hashlib.sha256(SECRET).hexdigest() not in out


@pytest.mark.parametrize("command", ["export", "export-hf"])
@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_checkpoint_naming_files_outside_is_refused(imported, tmp_path, capsys, case, command):
    ckpt, tag_dir, outside = _box(tmp_path, imported["ckpt"], TAG)
    named = TAMPERED[case](ckpt, tag_dir, outside)
    _check_refused(capsys, tmp_path, [command, ckpt, "--out", tmp_path / "out"], named, ckpt, outside)


def test_the_untampered_copy_exports(imported, tmp_path, capsys):
    ckpt, _tag_dir, outside = _box(tmp_path, imported["ckpt"], TAG)
    for command in ("export", "export-hf"):
        with _watching(outside) as opened:
            status, out = cli(capsys, [command, ckpt, "--out", tmp_path / command])
        assert status == 0 and not opened, out[-3000:]
    assert (tmp_path / "export-hf" / "tokenizer.json").read_bytes() == (ckpt / TAG / "hf" / "tokenizer.json").read_bytes()


# -- import-hf: the HF directory ---------------------------------------------------------------------
def _hf_box(tmp_path: Path, source: Path) -> tuple[Path, Path]:
    hf, outside = tmp_path / "hf", tmp_path / "outside"
    shutil.copytree(source, hf)
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(hf / name, outside / name)
    return hf, outside


def _index(hf: Path, shard: str) -> Path:
    """The weights replaced by an index naming ``shard`` for every tensor."""
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (hf / "model.safetensors").unlink()
    index = hf / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {name: shard for name in names}}))
    return index


def _index_absolute(hf, outside):
    return _index(hf, str(outside / "model.safetensors"))


def _index_dotdot(hf, outside):
    return _index(hf, "../outside/model.safetensors")


def _shard_link(hf, outside):
    index = _index(hf, "model-00001-of-00001.safetensors")
    (hf / "model-00001-of-00001.safetensors").symlink_to(outside / "model.safetensors")
    return hf / "model-00001-of-00001.safetensors"


def _config_link(hf, outside):
    _replace(hf / "config.json", "symlink", outside / "config.json")
    return hf / "config.json"


def _hf_tokenizer_link(hf, outside):
    _replace(hf / "tokenizer.json", "symlink", outside / "secret.txt")
    return hf / "tokenizer.json"


def _weights_hard_link(hf, outside):
    _replace(hf / "model.safetensors", "hardlink", outside / "model.safetensors")
    return hf / "model.safetensors"


HF_TAMPERED = {f.__name__[1:]: f for f in (_index_absolute, _index_dotdot, _shard_link, _config_link,
                                           _hf_tokenizer_link, _weights_hard_link)}


@pytest.mark.parametrize("case", list(HF_TAMPERED))
def test_an_hf_directory_naming_files_outside_is_refused(imported, tmp_path, capsys, case):
    hf, outside = _hf_box(tmp_path, imported["hf"])
    named = HF_TAMPERED[case](hf, outside)
    _check_refused(capsys, tmp_path, ["import-hf", hf, "--config", imported["config"], "--out", tmp_path / "out"],
                   named, hf, outside)


def test_preprocess_refuses_a_tokenizer_file_linked_outside(imported, tmp_path, capsys):
    hf, outside = _hf_box(tmp_path, imported["hf"])
    shutil.copyfile(hf / "tokenizer.json", outside / "tokenizer.json")   # what a followed link would read
    _replace(hf / "tokenizer.json", "symlink", outside / "tokenizer.json")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    _check_refused(capsys, tmp_path, ["preprocess", "--input", tmp_path / "text.jsonl", "--tokenizer", hf,
                                      "--output-prefix", tmp_path / "out"], hf / "tokenizer.json", hf, outside)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out_")]


def test_an_hf_cache_snapshot_may_link_into_its_blobs(imported, tmp_path, capsys):
    """The Hugging Face cache's layout (``models--ORG--NAME/snapshots/REV/*`` linking to ``../../blobs/``)
    imports: its links stay inside the repository's folder."""
    repo = tmp_path / "hub" / "models--tiny--mixtral"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for entry in sorted(imported["hf"].iterdir()):
        blob = repo / "blobs" / hashlib.sha256(entry.name.encode()).hexdigest()
        shutil.copyfile(entry, blob)
        (snapshot / entry.name).symlink_to(os.path.relpath(blob, snapshot))
    status, out = cli(capsys, ["import-hf", snapshot, "--config", imported["config"], "--out", tmp_path / "ckpt"])
    assert status == 0 and (tmp_path / "ckpt" / TAG / "hf" / "tokenizer.json").is_file(), out[-3000:]


# -- through the example on 2 ranks ------------------------------------------------------------------
FLAGS = [*MODEL_FLAGS[:MODEL_FLAGS.index("--eval-interval")], "--eval-interval", "0",
         *MODEL_FLAGS[MODEL_FLAGS.index("--eval-interval") + 2:]]


@contextlib.contextmanager
def _full_disk(rank: int, directory: str):
    """Inside, on rank 0: every file DeepSpeed writes under ``directory`` -- through its checkpoint
    engine's ``save`` and its copy of the recovery scripts -- gets a few bytes, then ENOSPC."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    save, copy = TorchCheckpointEngine.save, ds_engine.copyfile

    def full(path) -> bool:
        if rank == 0 and os.fspath(path).startswith(directory + os.sep):
            Path(path).write_bytes(b"partial")
            return True
        return False

    def saving(self, state_dict, path):
        if full(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return save(self, state_dict, path)

    def copying(src, dst, **kwargs):
        if full(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return copy(src, dst, **kwargs)

    TorchCheckpointEngine.save, ds_engine.copyfile = saving, copying
    try:
        yield
    finally:
        TorchCheckpointEngine.save, ds_engine.copyfile = save, copy


def _mains(rank: int, world_size: int, runs: list, outside: str) -> list[dict]:
    """The example's ``main`` once per ``(argv, full_disk_dir)``: its status, what it printed, and
    what it opened under ``outside``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = []
    for argv, full_disk, rewrite in runs:
        if rewrite:   # rank 0 copies the saved checkpoint and rewrites a file; rank 1 waits for it
            source, target, case = rewrite
            if rank == 0:
                shutil.copytree(source, target)
                REWRITTEN[case](Path(target) / "step1")
                Path(f"{target}.ready").touch()
            while not os.path.exists(f"{target}.ready"):
                time.sleep(0.05)
        out = io.StringIO()
        with _watching(Path(outside)) as opened, \
                (_full_disk(rank, full_disk) if full_disk else contextlib.nullcontext()), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = example_script().main(argv)
        results.append({"status": status, "out": out.getvalue(), "opened": opened})
    return results


def _rewritten(tag_dir: Path, name: str, change) -> Path:
    """``tag_dir/name`` (safetensors) with its tensors replaced by ``change({key: tensor})``, its recorded
    size and sha256 updated (as a tamperer would: the file's reader must refuse it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tag_dir / name
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    save_file(change(load_file(str(path))), str(path), metadata=metadata)
    _edit_meta(tag_dir, lambda m: m["files"].update({name: _digest(path)}))
    return path


def _expert_in_fp16(tag_dir: Path) -> Path:   # a load would cast it silently
    return _rewritten(tag_dir, EXPERT, lambda t: {k: v.half() for k, v in t.items()})


def _expert_transposed(tag_dir: Path) -> Path:
    return _rewritten(tag_dir, EXPERT, lambda t: {k: v.t().contiguous() if v.dim() == 2 else v for k, v in t.items()})


LOADED = {"files_absolute": _files_absolute, "expert_link": _expert_link, "tag_link": _tag_link}
# the example's own checkpoint (saved first in the same spawn), its files rewritten with their checksums
REWRITTEN = {"expert_in_fp16": _expert_in_fp16, "expert_transposed": _expert_transposed}
SAVED = ("tmp_link", "part_link", "full")


@pytest.fixture(scope="module")
def example(imported, tmp_path_factory):
    """In one spawn of the example on 2 ranks (ep 2, ZeRO-1): ``--load`` of three tampered copies of the
    imported checkpoint (``LOADED``), then one step and a save into a directory with a link planted at
    ``.tmp-step1`` (to a directory outside), one with ``latest.part`` a link to the secret, and one whose
    disk fills during DeepSpeed's writes."""
    from dist import run_distributed

    root = tmp_path_factory.mktemp("example")
    config = ds_config(root / "ds.json", 2, expert=2)
    argv = [*FLAGS, "--deepspeed_config", str(config), "--data-cache", str(root / "data"), "--no-plot"]
    boxes, runs = {}, []
    for case, tamper in LOADED.items():
        ckpt, tag_dir, outside = _box(root / case, imported["ckpt"], TAG)
        named = tamper(ckpt, tag_dir, outside)
        boxes[case] = {"named": named, "ckpt": ckpt, "before": snapshot(ckpt), "outside": outside,
                       "sentinel": snapshot(outside)}
        runs.append(([*argv, "--run-dir", str(root / "runs" / case), "--load", str(ckpt)], None, None))
    outside = root / "outside"
    (outside / "tmp").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "tmp" / "kept.txt").write_bytes(SECRET)
    for name in SAVED:
        (root / name).mkdir()
        runs.append(([*argv, "--run-dir", str(root / "runs" / name), "--train-iters", "1", "--save", str(root / name)],
                     str(root / name) if name == "full" else None, None))
    runs.append(([*argv, "--run-dir", str(root / "runs" / "saved"), "--train-iters", "1", "--save",
                  str(root / "saved")], None, None))
    for case in REWRITTEN:
        runs.append(([*argv, "--run-dir", str(root / "runs" / case), "--train-iters", "2", "--load", str(root / case)],
                     None, (str(root / "saved"), str(root / case), case)))
    (root / "tmp_link" / ".tmp-step1").symlink_to(outside / "tmp")
    (root / "part_link" / "latest.part").symlink_to(outside / "secret.txt")
    boxes.update({name: {"outside": outside, "sentinel": snapshot(outside)} for name in (*SAVED, "saved", *REWRITTEN)})
    results = run_distributed(_mains, 2, root, runs, str(root), timeout=600)
    for (case, box), ranks in zip(boxes.items(), zip(*results)):
        box["ranks"] = ranks
        for r in ranks:   # opened under the case's own outside/ (the rest of root is the run's)
            r["opened"] = [p for p in r["opened"] if p.startswith(os.path.realpath(box["outside"]) + os.sep)]
    return {"root": root, **boxes}


def _refused_on_rank_0(box: dict, named: Path) -> str:
    """Status 1 on both ranks, one line from rank 0 naming ``named``, no traceback, nothing opened or
    changed under ``outside/``."""
    ranks = box["ranks"]
    assert [r["status"] for r in ranks] == [1, 1], ranks[0]["out"][-3000:]
    line = _one_error_line(ranks[0]["out"], named)
    assert "error:" not in ranks[1]["out"] and "Traceback" not in ranks[1]["out"], ranks[1]["out"][-3000:]
    assert not [p for r in ranks for p in r["opened"]], [r["opened"] for r in ranks]
    assert snapshot(box["outside"]) == box["sentinel"]   # nothing written outside, nothing new there
    return line


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOADED))
def test_the_examples_load_refuses_files_outside(example, case):
    box = example[case]
    _refused_on_rank_0(box, box["named"])
    assert snapshot(box["ckpt"]) == box["before"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REWRITTEN))
def test_the_examples_load_refuses_a_tensor_its_metadata_does_not_record(example, case):
    """The example's own checkpoint, an expert file rewritten in fp16 or transposed (checksums updated):
    its ``--load`` is one line from rank 0 naming the file, status 1, before any step."""
    assert [r["status"] for r in example["saved"]["ranks"]] == [0, 0], example["saved"]["ranks"][0]["out"][-3000:]
    path = example["root"] / case / "step1" / EXPERT
    line = _refused_on_rank_0(example[case], path)
    assert ("torch.float16; the checkpoint's metadata records torch.float32" if case == "expert_in_fp16"
            else "; the checkpoint's metadata records [") in line, line


@pytest.mark.slow
def test_a_save_never_writes_through_a_planted_link(example):
    root = example["root"]
    line = _refused_on_rank_0(example["tmp_link"], root / "tmp_link" / ".tmp-step1")
    assert "a link to" in line and "left by an interrupted save" not in example["tmp_link"]["ranks"][0]["out"]
    _refused_on_rank_0(example["part_link"], root / "part_link" / "latest.part")
    assert sorted(os.listdir(root / "tmp_link")) == [".tmp-step1"]   # the link alone: nothing committed
    assert sorted(os.listdir(root / "part_link")) == ["latest.part"]


@pytest.mark.slow
def test_a_full_disk_during_deepspeeds_writes_is_one_line(example):
    full = example["root"] / "full"
    line = _refused_on_rank_0(example["full"], full)
    assert line.startswith(f"error: {full}: saving tag 'step1' failed, nothing was committed (OSError: [Errno "
                           f"{errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"), line
    assert line.endswith("no tag was committed there before; free space there or save elsewhere, then resume"), line
    assert os.listdir(full) == []   # the temporary tag removed, the partial files with it



def test_export_into_a_directory_holding_links_replaces_them_not_their_targets(imported, tmp_path, capsys):
    """``moe-plugin export`` into an ``--out`` where links were planted at ``model.safetensors``,
    ``config.json`` and their ``.part`` names (where they are written first): each link is replaced by
    the file, what it pointed at is untouched."""
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    out.mkdir()
    for name in ("model.safetensors", "config.json", "model.safetensors.part", "config.json.part"):
        (outside / name).write_bytes(SECRET)
        os.symlink(outside / name, out / name)
    status, printed = cli(capsys, ["export", imported["ckpt"], "--out", out])
    assert status == 0, printed[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not any(os.path.islink(out / name) for name in os.listdir(out))
    assert all((outside / name).read_bytes() == SECRET for name in os.listdir(outside))


def test_export_hf_into_the_users_own_link_writes_where_it_leads(imported, tmp_path, capsys):
    """``--out`` itself a link (the user's own argument, not a file from elsewhere): the export goes into
    the directory it leads to; the link stays."""
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    status, printed = cli(capsys, ["export-hf", imported["ckpt"], "--out", tmp_path / "link"])
    assert status == 0 and "Traceback" not in printed, printed[-3000:]
    assert os.path.islink(tmp_path / "link") and (tmp_path / "target" / "config.json").is_file()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
