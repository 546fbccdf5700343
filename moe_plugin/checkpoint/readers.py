"""A checkpoint's tensor files opened by their headers, each tensor read when asked.

    module = open_module(path, meta, stage, tp_rank)    # {state-dict key: Lazy or a plain value}
    entry = open_expert(path, meta, expert_id, stage)   # .expert_id, .weights {key: Lazy}, .optimizer
    value = materialize(module[key])

Safetensors files and DeepSpeed's ``torch.save`` files (read without running their pickle) both give
``Lazy`` values, each checked against the metadata's shape and dtype before it is read, so a reader
holds one tensor at a time. File kinds: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.metadata import expert_file, module_files, saved_model_files
from moe_plugin.checkpoint.optimizer import MASTER, RECORD_KIND, record_file
from moe_plugin.checkpoint.plain_files import read_plain
from moe_plugin.checkpoint.tensor_files import TensorFile
from moe_plugin.compat.torch_files import LazyTensor, TorchFile


class SafeLazy:
    """One tensor of a safetensors file, read by ``read``."""

    def __init__(self, source: TensorFile, name: str):
        self.source, self.name = source, name
        self.dtype, shape = source.spec(name)
        self.shape = torch.Size(shape)

    def read(self) -> torch.Tensor:
        return self.source.read(self.name)

    def read_rows(self, start: int, count: int) -> torch.Tensor:
        return self.source.read_rows(self.name, start, count)


class Rounded:
    """A lazy tensor read and cast to ``dtype`` (a weight kept as its fp32 master)."""

    def __init__(self, source: Any, dtype: torch.dtype):
        self.source, self.dtype, self.shape = source, dtype, source.shape

    def read(self) -> torch.Tensor:
        return self.source.read().to(self.dtype)


def rounded(file: str, key: str, master: Any, name: Any) -> Rounded:
    """The weight ``key`` that ``file`` keeps as its fp32 master ``master``, in the dtype ``name``."""
    dtype = getattr(torch, str(name), None)
    if master is None or not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{file}: {key} is recorded as its master in {name}, which the file lacks")
    return Rounded(master, dtype)


Lazy = Union[SafeLazy, LazyTensor, Rounded]


def is_lazy(value: Any) -> bool:
    return isinstance(value, (SafeLazy, LazyTensor, Rounded))


def materialize(value: Any) -> Any:
    return value.read() if is_lazy(value) else value


def materialize_all(value: Any) -> Any:
    """``value`` with every lazy tensor inside its dicts, lists and tuples read."""
    if isinstance(value, dict):
        return type(value)((k, materialize_all(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(materialize_all(v) for v in value)
    return materialize(value)


def open_module(path: str, meta: dict, stage: int, tp_rank: int) -> dict[str, Any]:
    """Saved (``stage``, ``tp_rank``)'s module state, tensors ``Lazy`` (weights left out: record masters, rounded)."""
    deepspeed = saved_model_files(path, meta, stage)[tp_rank]
    if meta.get("dense_files") is None:
        module = TorchFile(deepspeed).content.get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{deepspeed}: holds no module state")
        out, file = {**record_weights(path, stage, tp_rank), **module}, deepspeed
    else:
        file = module_files(path, meta, stage)[tp_rank]
        tensors = TensorFile(file)
        plain = TorchFile(deepspeed).content.get("module") or {}
        out = {k: v for k, v in plain.items() if not is_lazy(v)}
        out.update({name: SafeLazy(tensors, name) for name in tensors.names()})
    saved = meta["stages"][str(stage)]
    tp, cuts = int(meta.get("layout", {}).get("tp", 1)), saved.get("tp_split") or {}
    for key, value in out.items():
        if is_lazy(value) and key in saved["dense"]:
            shape = list(saved["dense"][key])
            if key in cuts:
                shape[cuts[key][0]] = shape[cuts[key][0]] // tp if shape[cuts[key][0]] % tp == 0 else -1
            check_claims(file, key, value, shape, saved.get("dtypes", {}).get(key))
    return out


def check_claims(file: str, key: str, value: Any, shape: list, dtype: Optional[str]) -> None:
    """A tensor of ``file`` checked against the metadata's shape and dtype before it is read (not cast)."""
    if list(value.shape) != list(shape):
        raise CheckpointError(f"{file}: {key}: shape {list(value.shape)}; the checkpoint's metadata records "
                              f"{list(shape)}")
    if dtype is not None and str(value.dtype) != dtype:
        raise CheckpointError(f"{file}: {key}: {value.dtype}; the checkpoint's metadata records {dtype} (a tensor "
                              "of another dtype is refused, not cast)")


def deepspeed_header(file: str) -> dict:
    """DeepSpeed's module file but its module state, read without running code or reading tensors."""
    with TorchFile(file) as f:
        if not isinstance(f.content, dict):
            raise CheckpointError(f"{file}: not a DeepSpeed module file")
        return {k: materialize_all(v) for k, v in f.content.items() if k != "module"}


def open_record(path: str, stage: int, tp_rank: int) -> Optional[dict]:
    """The optimizer record of saved (``stage``, ``tp_rank``), tensors ``Lazy``; None when there is none."""
    file = os.path.join(path, record_file(stage, tp_rank))
    return read_plain(file, RECORD_KIND, leaf=SafeLazy) if os.path.isfile(file) else None


def record_weights(path: str, stage: int, tp_rank: int) -> dict[str, Lazy]:
    """{key: weight} of saved (``stage``, ``tp_rank``)'s weights kept as fp32 masters, rounded back."""
    content = open_record(path, stage, tp_rank)
    if content is None:
        return {}
    file = os.path.join(path, record_file(stage, tp_rank))
    kept = content.get("weights") or {}
    out: dict[str, Lazy] = {}
    for key, dtype in (content.get("weights_from_master") or {}).items():
        master = content.get("state", {}).get(key, {}).get(MASTER)
        out[key] = kept[key] if key in kept else rounded(file, key, master, dtype)
    return out


@dataclass
class ExpertEntry:
    path: str
    expert_id: Any
    weights: dict[str, Lazy] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Lazy]] = field(default_factory=dict)
    placement: dict = field(default_factory=dict)


# a safetensors expert file: weights under their state-dict key, optimizer rows as "KEY@NAME"
OPTIMIZER_MARK = "@"


def open_expert_file(file: str) -> ExpertEntry:
    f = TensorFile(file)
    entry = ExpertEntry(file, _int(f.metadata.get("expert_id")), placement=json.loads(f.metadata.get("placement", "{}")))
    for name in f.names():
        key, _, state = name.partition(OPTIMIZER_MARK)
        if state:
            entry.optimizer.setdefault(key, {})[state] = SafeLazy(f, name)
        else:
            entry.weights[key] = SafeLazy(f, name)
    _rounded(entry, json.loads(f.metadata.get("weights_from_master", "{}")))
    return entry


def _rounded(entry: ExpertEntry, from_master: dict) -> None:
    """The weights ``from_master`` ({key: dtype}) names: its master rows, rounded when read."""
    for key, dtype in from_master.items():
        entry.weights[key] = rounded(entry.path, key, entry.optimizer.get(key, {}).get(MASTER), dtype)


def open_expert(path: str, meta: dict, expert_id: int, stage: int) -> ExpertEntry:
    """Expert ``expert_id``'s file of ``stage``, checked against the metadata."""
    entry = open_expert_file(expert_file(path, expert_id, stage))
    saved = meta["stages"][str(stage)]
    for key, value in entry.weights.items():
        if key in saved.get("experts", {}):
            check_claims(entry.path, key, value, list(saved["experts"][key])[1:], saved.get("dtypes", {}).get(key))
    for key, states in entry.optimizer.items():
        for name, value in states.items():
            if key in saved.get("experts", {}):
                check_claims(entry.path, f"{key}{OPTIMIZER_MARK}{name}", value, list(saved["experts"][key])[1:],
                             str(torch.float32))   # masters and moments: fp32, as every save writes them
    return entry


def _int(text: Any) -> Any:
    try:
        return int(text)
    except (TypeError, ValueError):
        return text


def expert_file_specs(weights: dict[str, tuple], optimizer: dict[str, dict[str, tuple]]) -> dict[str, tuple]:
    """The tensor plan of a safetensors expert file: {name: (dtype, shape)}."""
    specs = dict(sorted(weights.items()))
    for key in sorted(optimizer):
        for state, spec in sorted(optimizer[key].items()):
            specs[key + OPTIMIZER_MARK + state] = spec
    return specs


def expert_file_metadata(expert_id: int, stage: int, placement: dict,
                         from_master: Optional[dict[str, str]] = None) -> dict[str, str]:
    """A safetensors expert file's metadata; ``from_master``: {key: dtype} of weights kept as masters."""
    out = {"expert_id": str(expert_id), "stage": str(stage), "placement": json.dumps(placement)}
    if from_master:
        out["weights_from_master"] = json.dumps(from_master, sort_keys=True)
    return out
