"""``moe_plugin/checkpoint/tensor_files.py``: safetensors read and written one tensor at a time,
the same files ``safetensors`` reads and writes, and damaged files refused naming the file."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.tensor_files import TensorFile, TensorWriter

TENSORS = {"a": torch.randn(5, 3), "b": torch.randn(4).bfloat16(), "c": torch.arange(7), "d": torch.tensor(2.5),
           "e": torch.zeros(0, 2), "f": torch.tensor([True, False]), "g": torch.randn(2, 3).half()}


def test_safetensors_files_read_here_and_ours_read_there(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    save_file(TENSORS, tmp_path / "theirs.safetensors", metadata={"k": "v"})
    with TensorFile(tmp_path / "theirs.safetensors") as f:
        assert f.metadata == {"k": "v"} and sorted(f.names()) == sorted(TENSORS)
        assert all(torch.equal(f.read(k), v) for k, v in TENSORS.items())
        assert torch.equal(f.read_rows("a", 1, 3), TENSORS["a"][1:4])
    specs = {k: (v.dtype, list(v.shape)) for k, v in TENSORS.items()}
    with TensorWriter(tmp_path / "ours.safetensors", specs, {"x": "y"}) as out:
        for k in reversed(list(TENSORS)):   # any order
            if k == "a":
                out.write_rows("a", 2, TENSORS["a"][2:])
                out.write_rows("a", 0, TENSORS["a"][:2])
            else:
                out.write(k, TENSORS[k])
    back = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(back[k], v) for k, v in TENSORS.items())
    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert f.metadata() == {"x": "y"}


def test_a_writer_missing_a_tensor_or_given_another_shape_leaves_no_file(tmp_path):
    specs = {"a": (torch.float32, [2, 2]), "b": (torch.float32, [3])}
    with pytest.raises(ValueError, match="never written, e.g. b"):
        with TensorWriter(tmp_path / "x.safetensors", specs) as out:
            out.write("a", torch.zeros(2, 2))
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match=r"a is torch.float32 \[3\], planned torch.float32 \[2, 2\]"):
        with TensorWriter(tmp_path / "x.safetensors", specs) as out:
            out.write("a", torch.zeros(3))
    assert not (tmp_path / "x.safetensors").exists()


def _header_file(path, header: dict, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("make, why", [
    (lambda p: p.write_bytes(b"abc"), "3 bytes"),
    (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "a header of"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "its header is not JSON"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
     "the file has"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "F32 \\[2\\] in 4 bytes"),
    (lambda p: _header_file(p, {"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "tensor 'w'"),
    (lambda p: _header_file(p, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "v": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12),
     "starts at byte 8"),
])
def test_damaged_files_are_refused_naming_the_file(tmp_path, make, why):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(CheckpointError, match=f"bad.safetensors: not a safetensors file .*{why}"):
        TensorFile(path)


def test_a_missing_file_and_tensor_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="nothing.safetensors: missing"):
        TensorFile(tmp_path / "nothing.safetensors")
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    with TensorFile(tmp_path / "x.safetensors") as f, pytest.raises(CheckpointError, match="holds no tensor 'b'"):
        f.read("b")
