"""Gate traces: per step and MoE layer, the tokens per expert and the sender x expert traffic, one
fixed-size binary record per step after a JSON header, appended and flushed as the run goes, written
by global rank 0 (the planner's input). The layout: docs/design/placement_load.md.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

MAGIC = b"MOETRACE"
VERSION = 1
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header bytes
_INT32_MAX = 2 ** 31 - 1

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


@dataclass(frozen=True)
class TraceMeta:
    """A trace's header: the layer names (record order), E, P and free JSON ``info``."""

    layers: tuple[str, ...]
    num_experts: int
    ep_size: int = 1
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(str(name) for name in self.layers))
        if not self.layers:
            raise ValueError("a gate trace needs at least one layer name, got none")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"gate trace layer names must be distinct, got {list(self.layers)}")
        for key in ("num_experts", "ep_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"gate trace {key} must be a positive integer, got {value!r}")

    @property
    def record_dtype(self) -> np.dtype:
        """The numpy dtype of one step's record."""
        n, E, P = len(self.layers), self.num_experts, self.ep_size
        return np.dtype([("step", "<i8"), ("load", "<i4", (n, E)), ("traffic", "<i4", (n, P, E))])

    @property
    def bytes_per_step(self) -> int:
        return self.record_dtype.itemsize

    def to_json(self) -> dict:
        return {"num_experts": self.num_experts, "ep_size": self.ep_size, "layers": list(self.layers),
                "info": self.info}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TraceMeta":
        return cls(layers=tuple(data["layers"]), num_experts=int(data["num_experts"]),
                   ep_size=int(data["ep_size"]), info=dict(data.get("info", {})))


def _header_bytes(meta: TraceMeta) -> bytes:
    body = json.dumps(meta.to_json(), sort_keys=True).encode("utf-8")
    return _PREAMBLE.pack(MAGIC, VERSION, len(body)) + body


def _read_header(handle, path: Path) -> tuple[TraceMeta, int]:
    """The meta of an open trace file and the byte offset of its first record."""
    preamble = handle.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size:
        raise ValueError(f"{path} is not a gate trace: {len(preamble)} bytes, shorter than the "
                         f"{_PREAMBLE.size}-byte preamble")
    magic, version, n = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a gate trace: it starts with {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"{path} is gate trace version {version}; this reader knows version {VERSION}")
    body = handle.read(n)
    if len(body) != n:
        raise ValueError(f"{path} has a truncated header: {len(body)} of {n} bytes")
    return TraceMeta.from_json(json.loads(body.decode("utf-8"))), _PREAMBLE.size + n


def _as_int32(value: ArrayLike, shape: tuple[int, ...], what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.shape != shape:
        raise ValueError(f"{what} has shape {tuple(array.shape)}, expected {shape}")
    if array.size and (array.min() < 0 or array.max() > _INT32_MAX):
        raise ValueError(f"{what} holds {array.min()}..{array.max()}, outside 0..{_INT32_MAX} (int32 counts)")
    return array.astype("<i4", copy=False)


class TraceWriter:
    """Appends one record per step to a gate trace; ``append=True`` continues one with the same header.
    Not collective: global rank 0 only. Also a context manager."""

    def __init__(self, path: Union[str, os.PathLike], meta: Union[TraceMeta, Mapping[str, Any]], *,
                 append: bool = False):
        self.path = Path(path)
        meta = meta if isinstance(meta, TraceMeta) else TraceMeta.from_json(meta)
        self.meta = meta
        self._dtype = meta.record_dtype
        self._index = {name: i for i, name in enumerate(meta.layers)}
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as handle:
                found, start = _read_header(handle, self.path)
            if (found.layers, found.num_experts, found.ep_size) != (meta.layers, meta.num_experts, meta.ep_size):
                raise ValueError(f"cannot append to {self.path}: it traces layers {list(found.layers)} with "
                                 f"E={found.num_experts}, P={found.ep_size}, not {list(meta.layers)} with "
                                 f"E={meta.num_experts}, P={meta.ep_size}")
            whole = (self.path.stat().st_size - start) // self._dtype.itemsize
            self._file = open(self.path, "r+b")
            self._file.truncate(start + whole * self._dtype.itemsize)  # drop a torn last record
            self._file.seek(0, os.SEEK_END)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "wb")
            self._file.write(_header_bytes(meta))
            self._file.flush()

    def append(self, step: int, layers: Mapping[str, tuple[ArrayLike, Optional[ArrayLike]]]) -> None:
        """Write step ``step``: ``{layer name: (load_E, traffic_PE)}`` for every layer of the header
        (``traffic_PE`` None with P 1: ``load`` written as the kept load)."""
        if self._file is None:
            raise RuntimeError(f"gate trace {self.path} is closed; cannot append step {step}")
        missing = [name for name in self.meta.layers if name not in layers]
        unknown = [name for name in layers if name not in self._index]
        if missing or unknown:
            raise ValueError(f"step {step}: the trace has layers {list(self.meta.layers)}; missing "
                             f"{missing}, unknown {unknown}")
        E, P = self.meta.num_experts, self.meta.ep_size
        record = np.zeros((), dtype=self._dtype)
        record["step"] = int(step)
        for name, (load_E, traffic_PE) in layers.items():
            i = self._index[name]
            record["load"][i] = _as_int32(load_E, (E,), f"step {step} layer {name} load")
            if traffic_PE is None:
                if P != 1:
                    raise ValueError(f"step {step} layer {name}: traffic is None but the trace has P={P} senders")
                traffic_PE = record["load"][i][None]
            record["traffic"][i] = _as_int32(traffic_PE, (P, E), f"step {step} layer {name} traffic")
        self._file.write(record.tobytes())
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class GateTrace:
    """A trace read back: ``load`` [steps, layers, E], ``traffic`` [steps, layers, P, E], ``steps``."""

    meta: TraceMeta
    steps: np.ndarray
    load: np.ndarray
    traffic: np.ndarray

    # the header's, for short
    layers = property(lambda self: self.meta.layers)
    num_experts = property(lambda self: self.meta.num_experts)
    ep_size = property(lambda self: self.meta.ep_size)

    def layer(self, name: str) -> int:
        """Index of layer ``name`` on the layers axis."""
        try:
            return self.meta.layers.index(name)
        except ValueError:
            raise KeyError(f"layer {name!r} is not in the trace; it has {list(self.meta.layers)}") from None

    def kept(self) -> np.ndarray:
        """[steps, layers, E] routes each expert processed (the traffic summed over senders)."""
        return self.traffic.sum(axis=-2)

    def torch(self) -> dict[str, torch.Tensor]:
        """``steps``, ``load`` and ``traffic`` as int64 torch tensors."""
        return {"steps": torch.from_numpy(self.steps.astype(np.int64)),
                "load": torch.from_numpy(self.load.astype(np.int64)),
                "traffic": torch.from_numpy(self.traffic.astype(np.int64))}


def read_trace(path: Union[str, os.PathLike]) -> GateTrace:
    """Read a whole gate trace. A torn last record (the writer died mid-write) is ignored."""
    path = Path(path)
    with open(path, "rb") as handle:
        meta, start = _read_header(handle, path)
        dtype = meta.record_dtype
        data = handle.read()
    count = len(data) // dtype.itemsize
    records = np.frombuffer(data[:count * dtype.itemsize], dtype=dtype)
    return GateTrace(meta=meta, steps=records["step"].copy(), load=records["load"].copy(),
                     traffic=records["traffic"].copy())
