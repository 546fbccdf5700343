"""What a tensor file claims is checked against the bytes that are there before memory is reserved.

A ``torch.save`` file (DeepSpeed's module and optimizer files, read by ``compat/torch_files.py``
without running its pickle) describes each tensor by a storage (a record of the archive and its
element count), an offset, sizes and strides, all of them the file's word: a tensor claiming
``[2**40]`` elements of a 16-byte storage, a stride of ``2**38``, a negative offset, a storage
whose count disagrees with its record, or a record the archive compresses or places past its end
is one line naming the file, before anything is allocated."""
from __future__ import annotations

import collections
import os
import resource
import zipfile

import pytest
import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.compat.torch_files import TorchFile


class _Claim:
    """Pickles as torch pickles a tensor, with the offset, sizes and strides given."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _storage():
    """A 4-element float32 storage, as torch.save pickles a tensor's (a TypedStorage)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # TypedStorage is deprecated, and what torch.save still writes
        return torch.arange(4, dtype=torch.float32).storage()


CLAIMS = {
    "huge-shape": (0, (2 ** 40,), (1,), r"claims shape \[1099511627776\], stride \[1\] from offset 0: past the "
                                        r"storage's 4 elements of torch\.float32"),
    "huge-stride": (0, (2, 2), (2 ** 38, 1), r"claims shape \[2, 2\], stride \[274877906944, 1\] from offset 0: past"),
    "offset-past": (3, (2,), (1,), r"claims shape \[2\], stride \[1\] from offset 3: past the storage's 4 elements"),
    "negative-offset": (-1, (2,), (1,), r"has offset -1, shape \(2,\), stride \(1,\); expected counts"),
    "negative-size": (0, (-2,), (1,), r"has offset 0, shape \(-2,\), stride \(1,\); expected counts"),
    "strides-short": (0, (2, 2), (1,), r"has offset 0, shape \(2, 2\), stride \(1,\); expected counts, as many"),
}


@pytest.mark.parametrize("case", sorted(CLAIMS))
def test_a_tensor_claiming_more_than_its_storage_is_refused(tmp_path, case):
    offset, size, stride, message = CLAIMS[case]
    path = tmp_path / "module.pt"
    torch.save({"module": {"w": _Claim(_storage(), offset, size, stride)}}, path)
    with pytest.raises(CheckpointError, match=f"^{path}: a tensor of storage '0' " + message):
        TorchFile(path)


def _rewrite(path, change) -> None:
    """The archive at ``path`` written again, ``change(name, data, info)`` giving each record's new bytes
    (None: as it was) and compression."""
    with zipfile.ZipFile(path) as z:
        records = [(info, z.read(info.filename)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in records:
            data, compression = change(info.filename, data) or (data, zipfile.ZIP_STORED)
            z.writestr(info.filename, data, compress_type=compression)


def test_a_storage_whose_record_disagrees_or_is_compressed_is_refused(tmp_path):
    path = tmp_path / "module.pt"
    torch.save({"module": {"w": torch.arange(4, dtype=torch.float32)}}, path)
    _rewrite(path, lambda name, data: (data[:8], zipfile.ZIP_STORED) if name.endswith("/data/0") else None)
    with pytest.raises(CheckpointError, match=rf"^{path}: storage '0' claims 4 elements of torch\.float32 \(16 bytes\); "
                                              r"its record holds 8 bytes$"):
        TorchFile(path)
    torch.save({"module": {"w": torch.zeros(1 << 16)}}, path)
    _rewrite(path, lambda name, data: (data, zipfile.ZIP_DEFLATED) if name.endswith("/data/0") else None)
    with pytest.raises(CheckpointError, match=rf"^{path}: record \S+/data/0 claims 262144 bytes \(\d+ stored, "
                                              r"compression 8\) in a file of \d+; torch\.save stores its records"):
        TorchFile(path)


def test_the_claims_are_refused_before_any_allocation(tmp_path):
    """A tensor of 2**40 float32 elements (4 TiB) over a 16-byte storage: refused, and the process's
    peak memory has not grown by more than a few MB (the refusal reserved nothing)."""
    path = tmp_path / "module.pt"
    torch.save({"module": {"w": _Claim(_storage(), 0, (2 ** 40,), (1,))}}, path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError):
        TorchFile(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024   # KiB
    assert os.path.getsize(path) < 4096


def test_honest_files_still_read_bit_exactly(tmp_path):
    base = torch.randn(6, 4)
    tensors = {"view": base[2:5], "transposed": base.t(), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
               "offset": base.flatten()[5:9], "expanded": torch.randn(3, 1).expand(3, 4)}
    torch.save(tensors, tmp_path / "f.pt")
    with TorchFile(tmp_path / "f.pt") as f:
        for name, value in tensors.items():
            assert torch.equal(f.content[name].read(), value), name


# -- a checkpoint's tensors against its metadata, through `moe-plugin export` ----------------------

@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny Mixtral imported as ``moe-plugin import-hf`` imports it (safetensors dense and expert files)."""
    from hf_tiny import import_tiny

    return import_tiny(tmp_path_factory.mktemp("imported"))["ckpt"]


def _tampered(ckpt, tmp_path, name: str, change) -> str:
    """A copy of ``ckpt`` whose safetensors file ``name`` (relative to the tag) has its tensors replaced by
    ``change({name: tensor})``, the metadata's record of the file's size and sha256 updated to match."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from moe_plugin.checkpoint.files import file_digest

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    path = copy / "step0" / name
    tensors = load_file(str(path))
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    save_file(change(tensors), str(path), metadata=header.get("__metadata__"))
    meta_path = copy / "step0" / "moe_plugin.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][name] = file_digest(str(path))
    meta_path.write_text(json.dumps(meta))
    return str(path)


def _export(capsys, ckpt, out) -> tuple[int, str]:
    from commands import cli

    return cli(capsys, ["export", ckpt, "--out", out])


EXPERT, DENSE = "experts/expert_00003_pp_00.safetensors", "model/dense_pp_00_tp_00.safetensors"
W2, EMB = "decoder.layers.1.mlp.experts.weight2", "embedding.word_embeddings.weight"
TAMPERED = {
    "expert-in-fp16": (EXPERT, lambda t: {**t, W2: t[W2].half()},
                       f"{W2}: torch.float16; the checkpoint's metadata records torch.float32 (a tensor of another "
                       "dtype is refused, not cast)"),
    "expert-in-fp64": (EXPERT, lambda t: {**t, W2: t[W2].double()}, f"{W2}: torch.float64; the checkpoint's"),
    "expert-transposed": (EXPERT, lambda t: {**t, W2: t[W2].t().contiguous()},
                          f"{W2}: shape [64, 32]; the checkpoint's metadata records [32, 64]"),
    "embedding-in-fp64": (DENSE, lambda t: {**t, EMB: t[EMB].double()}, f"{EMB}: torch.float64; the checkpoint's"),
    "embedding-half-rows": (DENSE, lambda t: {**t, EMB: t[EMB][:192].contiguous()},
                            f"{EMB}: shape [192, 64]; the checkpoint's metadata records [384, 64]"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_export_refuses_a_tensor_the_metadata_does_not_record(imported, tmp_path, capsys, case):
    """A tensor file whose checksum was updated after it was changed: another dtype or shape than the
    metadata records is one line naming the file and the key, status 2, nothing written."""
    name, change, message = TAMPERED[case]
    path = _tampered(imported, tmp_path, name, change)
    status, printed = _export(capsys, tmp_path / "ckpt", tmp_path / "out")
    lines = [line for line in printed.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in printed, printed[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {message}"), lines
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_safe_load_checks_the_claims_first(tmp_path):
    """``safe_load`` (DeepSpeed's own load of its files, ``reading_safely``) refuses what ``TorchFile`` refuses."""
    from moe_plugin.compat.torch_files import safe_load

    path = tmp_path / "optim.pt"
    torch.save({"state": {"w": _Claim(_storage(), 0, (2 ** 40,), (1,))}}, path)
    with pytest.raises(CheckpointError, match=f"^{path}: a tensor of storage '0' claims shape"):
        safe_load(str(path))
    torch.save({"w": torch.arange(3)}, path)
    assert torch.equal(safe_load(str(path))["w"], torch.arange(3))


def _with_meta(ckpt, tmp_path, change) -> str:
    import json
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    path = copy / "step0" / "moe_plugin.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    return str(path)


def _more_experts(meta) -> None:   # 16 experts recorded, consistently, over the 8 files of the tag
    meta["num_experts"] = 16
    for key, shape in meta["stages"]["0"]["experts"].items():
        shape[0] = 16


SIZED = {
    "experts-1e9": (lambda m: m.update(num_experts=10 ** 9), r"num_experts: 1000000000; expected a count up to 1048576"),
    "experts-16": (_more_experts, r"num_experts: 16; the tag lists no expert file for expert 8 of stage 0 \(8 missing\)"),
    "embedding-1e12-rows": (lambda m: m["stages"]["0"]["dense"][EMB].__setitem__(0, 10 ** 12),
                            r"stages: the recorded shapes hold \d+ elements; the tag's files hold \d+ bytes"),
    "tp-0": (lambda m: m["layout"].update(tp=0), r"layout\.tp: 0; expected a count from 1 to 1048576"),
    "shape-string": (lambda m: m["stages"]["0"]["dense"].update({EMB: "384x64"}),
                     rf"stages\.0\.dense\.{EMB}: 384x64; expected a shape of counts"),
}


@pytest.mark.parametrize("case", sorted(SIZED))
def test_export_refuses_recorded_sizes_that_do_not_hold_together(imported, tmp_path, capsys, case):
    """The metadata's sizes are checked against each other and the tag's bytes before anything is sized
    by them (a reader would loop over 10**9 experts, or reserve an output of 10**12 rows)."""
    import re

    change, message = SIZED[case]
    path = _with_meta(imported, tmp_path, change)
    status, printed = _export(capsys, tmp_path / "ckpt", tmp_path / "out")
    lines = [line for line in printed.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in printed and len(lines) == 1, printed[-3000:]
    assert re.match(f"^error: {re.escape(path)}: {message}", lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
