"""Files of plain data with tensors in it, and no code: a safetensors file holding the tensors, the
rest as JSON in its header (the optimizer record, every rank's random streams).

    write_plain("rng/rank_00000.safetensors", {"torch": t, "python": random.getstate()}, kind="rng")
    state = read_plain("rng/rank_00000.safetensors", kind="rng")      # the same values back
    record = read_plain(path, kind="optimizer_record", leaf=lazy)     # tensors as lazy(file, name)

A file may hold None, bool, int, float, str, lists, tuples, dicts, tensors, NumPy arrays and torch
dtypes; writing anything else fails naming where it is. Reading never calls a constructor a file
names, and ``kind`` is checked. Encoding: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Optional

import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.tensor_files import DTYPES, NAMES, TensorFile, TensorWriter

CONTENT, KIND = "content", "kind"
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in DTYPES.values()}


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


class _Encoder:
    def __init__(self, path: str):
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor) or _is_lazy(value):
            if value.dtype not in NAMES:
                raise CheckpointError(f"{self.path}: {where or '/'} is a {value.dtype} tensor, which safetensors "
                                      "cannot hold")
            self.tensors[where] = value if _is_lazy(value) else value.detach()
            return {"@tensor": where}
        if isinstance(value, torch.dtype):
            return {"@dtype": str(value).removeprefix("torch.")}
        if isinstance(value, tuple):
            return {"@tuple": [self.encode(v, f"{where}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}/{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("@") for k in value):
                return {k: self.encode(v, f"{where}/{_escape(k)}") for k, v in value.items()}
            return {"@items": [[self.encode(k, f"{where}/{i}k"), self.encode(v, f"{where}/{i}")]
                               for i, (k, v) in enumerate(value.items())]}
        if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            kept = value.dtype.kind not in "iub" or str(value.dtype) in _DTYPE_NAMES
            wide = value if kept else value.astype("int64")
            self.tensors[where] = torch.from_numpy(wide.copy())
            return {"@ndarray": where, "dtype": str(value.dtype)}
        raise CheckpointError(f"{self.path}: {where or '/'} is a {type(value).__module__}.{type(value).__qualname__}, "
                              "which a checkpoint file of plain data cannot hold")


def write_plain(path: str, value: Any, kind: str) -> None:
    """``value`` as the safetensors file ``path``, its tensors in the order met."""
    encoder = _Encoder(path)
    content = encoder.encode(value, "")
    specs = {name: (t.dtype, list(t.shape)) for name, t in encoder.tensors.items()}
    metadata = {KIND: kind, CONTENT: json.dumps(content, separators=(",", ":"))}
    with TensorWriter(path, specs, metadata) as out:
        for name, tensor in encoder.tensors.items():
            out.write(name, tensor.read() if _is_lazy(tensor) else tensor)


def _is_lazy(value: Any) -> bool:
    """A tensor not read yet (``torch_files.LazyTensor``, ``readers.SafeLazy``): dtype, shape, ``read()``."""
    return not isinstance(value, torch.Tensor) and all(hasattr(value, a) for a in ("dtype", "shape", "read"))


def read_plain(path: str, kind: str, leaf: Optional[Callable[[TensorFile, str], Any]] = None) -> Any:
    """What ``write_plain`` wrote into ``path`` (of ``kind``); ``leaf(file, name)`` stands for each tensor."""
    source = TensorFile(path)
    found = source.metadata.get(KIND)
    if found != kind:
        source.close()
        raise CheckpointError(f"{path}: holds {found or 'no kind'!r}, expected a file of {kind!r}")
    try:
        content = json.loads(source.metadata.get(CONTENT, "null"))
    except json.JSONDecodeError as exc:
        source.close()
        raise CheckpointError(f"{path}: its content is not JSON ({exc})") from None
    read = leaf or (lambda f, name: f.read(name))

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1 and "@tensor" in value:
            return read(source, str(value["@tensor"]))
        if len(value) == 1 and "@tuple" in value:
            return tuple(decode(v) for v in value["@tuple"])
        if len(value) == 1 and "@items" in value:
            return {_hashable(decode(k)): decode(v) for k, v in value["@items"]}
        if len(value) == 1 and "@dtype" in value and value["@dtype"] in _DTYPE_NAMES:
            return _DTYPE_NAMES[value["@dtype"]]
        if set(value) == {"@ndarray", "dtype"}:
            import numpy

            return source.read(str(value["@ndarray"])).numpy().astype(numpy.dtype(str(value["dtype"])))
        return {k: decode(v) for k, v in value.items()}

    try:
        return decode(content)
    finally:
        if leaf is None:
            source.close()


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
