"""safetensors files read and written one tensor at a time.

    with TensorFile("model.safetensors") as f:          # the header only
        f.names(), f.spec("w")                          # (dtype, shape), nothing read yet
        w = f.read("w")                                 # this tensor's bytes, into memory of its own
        rows = f.read_rows("w", 128, 64)                # rows [128, 192) of dim 0
    with TensorWriter("out.safetensors", {"w": (torch.float32, [4, 8])}, metadata={"k": "v"}) as out:
        out.write("w", tensor)                          # in any order, each once

Compatible with ``safetensors`` both ways. No pickle, no code, no mmap (each tensor read with
``os.preadv``); a damaged header or byte ranges are refused in one line naming the file. Why not
safetensors' own reader: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Mapping, Optional, Sequence

import torch

from moe_plugin.checkpoint.confine import CREATE_NEW
from moe_plugin.checkpoint.errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
HEADER_LIMIT = 100 << 20   # safetensors' own bound on a header
PART = ".part"   # where a TensorWriter writes until it closes
META = "__metadata__"
SUFFIX = ".safetensors"

Spec = tuple[torch.dtype, list[int]]


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


class TensorFile:
    """One safetensors file, read tensor by tensor."""

    def __init__(self, path: os.PathLike | str):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing") from None
        try:
            self._specs, self._offsets, self.metadata, self._data = _header(self.path, self._fd)
        except BaseException:
            os.close(self._fd)
            raise

    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def spec(self, name: str) -> Spec:
        try:
            return self._specs[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: holds no tensor {name!r}") from None

    def read(self, name: str) -> torch.Tensor:
        dtype, shape = self.spec(name)
        return self._read(name, self._offsets[name][0], dtype, shape)

    def read_rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of dim 0 (contiguous on disk): only their bytes are read."""
        dtype, shape = self.spec(name)
        if not shape or start < 0 or count < 0 or start + count > shape[0]:
            raise CheckpointError(f"{self.path}: rows [{start}, {start + count}) of {name!r} {shape}")
        row = nbytes(dtype, shape[1:])
        return self._read(name, self._offsets[name][0] + start * row, dtype, [count, *shape[1:]])

    def _read(self, name: str, begin: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        size = nbytes(dtype, shape)
        if size == 0:
            return out
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < size:   # pread may return less than asked
            got = os.preadv(self._fd, [view[done:]], self._data + begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: ends inside {name!r} (truncated)")
            done += got
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(path: str, fd: int) -> tuple[dict[str, Spec], dict[str, tuple[int, int]], dict[str, str], int]:
    size = os.fstat(fd).st_size

    head = os.pread(fd, 8, 0)
    # what a file that fails to parse looks like instead: a zip (torch.save) or a bare pickle is never unpickled
    looks = ("a torch.save zip, which is never read here: unpickling can run code" if head.startswith(b"PK\x03\x04")
             else "it looks like a pickle, which is never read here: unpickling can run code"
             if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") else "")

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a safetensors file ({looks or why})")

    if len(head) < 8:
        raise refuse(f"{size} bytes")
    (length,) = struct.unpack("<Q", head)
    if length > min(HEADER_LIMIT, size - 8):
        raise refuse(f"a header of {length} bytes in a file of {size}")
    try:
        header = json.loads(os.pread(fd, length, 8).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    metadata = header.pop(META, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise refuse(f"{META} is not a map of strings")
    specs, offsets = {}, {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise refuse(f"tensor {name!r}: {str(entry)[:80]}") from None
        if end - begin != nbytes(dtype, shape) or min(shape, default=0) < 0:
            raise refuse(f"tensor {name!r}: {entry['dtype']} {shape} in {end - begin} bytes")
        specs[name], offsets[name] = (dtype, shape), (begin, end)
    position = 0
    for name, (begin, end) in sorted(offsets.items(), key=lambda item: item[1]):
        if begin != position:
            raise refuse(f"tensor {name!r} starts at byte {begin}, the one before it ends at {position}")
        position = end
    if 8 + length + position != size:
        raise refuse(f"its tensors end at byte {8 + length + position}, the file has {size} (truncated or appended to)")
    return specs, offsets, metadata, 8 + length


class TensorWriter:
    """A safetensors file written tensor by tensor, ``specs`` ({name: (dtype, shape)}) fixing the header.
    Written to ``PATH.part``, created new, renamed at ``close``, which names a tensor not written."""

    def __init__(self, path: os.PathLike | str, specs: Mapping[str, Spec], metadata: Optional[Mapping[str, str]] = None):
        self.path = os.fspath(path)
        self._specs = {name: (dtype, [int(d) for d in shape]) for name, (dtype, shape) in specs.items()}
        self._offsets, position = {}, 0
        header: dict = {META: dict(metadata)} if metadata else {}
        for name, (dtype, shape) in self._specs.items():
            if dtype not in NAMES:
                raise ValueError(f"{self.path}: {name}: dtype {dtype} has no safetensors name")
            size = nbytes(dtype, shape)
            self._offsets[name] = position
            header[name] = {"dtype": NAMES[dtype], "shape": shape, "data_offsets": [position, position + size]}
            position += size
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._data, self._end = 8 + len(text), 8 + len(text) + position
        self._left, self._rows = set(self._specs), {}
        self._part = self.path + PART
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._part)   # a stale one (removing a link removes the link, never its target)
        self._fd = os.open(self._part, CREATE_NEW, 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(self._fd, self._end)
        except BaseException:
            self.abandon()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The whole of ``name``."""
        self._put(name, 0, tensor, None)

    def write_rows(self, name: str, start: int, tensor: torch.Tensor) -> None:
        """Rows ``[start, start + len(tensor))`` of dim 0 of ``name`` (every row once, in any order)."""
        dtype, shape = self._spec(name)
        count = tensor.shape[0] if tensor.dim() else 0
        if not shape or start < 0 or start + count > shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {start + count}) of {name!r} {shape}")
        self._put(name, start * nbytes(dtype, shape[1:]), tensor, [count, *shape[1:]])

    def _spec(self, name: str) -> Spec:
        if name not in self._specs:
            raise ValueError(f"{self.path}: {name!r} is not one of the tensors planned for this file")
        return self._specs[name]

    def _put(self, name: str, at: int, tensor: torch.Tensor, rows: Optional[list[int]]) -> None:
        dtype, planned = self._spec(name)
        if tensor.dtype != dtype or list(tensor.shape) != (planned if rows is None else rows):
            raise ValueError(f"{self.path}: {name} is {tensor.dtype} {list(tensor.shape)}, planned {dtype} {planned}"
                             + ("" if rows is None else f" (rows {rows})"))
        if name not in self._left:
            raise ValueError(f"{self.path}: {name} written twice")
        data = memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self._fd, data[done:], self._data + self._offsets[name] + at + done)
        except BaseException:
            self.abandon()
            raise
        whole = planned[0] if planned else 1
        self._rows[name] = self._rows.get(name, 0) + (whole if rows is None else rows[0])
        if self._rows[name] >= whole:
            self._left.discard(name)

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._left:
            self.abandon()
            raise ValueError(f"{self.path}: {len(self._left)} planned tensor(s) never written, e.g. {sorted(self._left)[0]}")
        os.close(self._fd)
        self._fd = -1
        os.replace(self._part, self.path)

    def abandon(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._part)

    def __enter__(self) -> "TensorWriter":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None:
            self.abandon()
        else:
            self.close()

