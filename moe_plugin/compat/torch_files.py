"""Files written by ``torch.save`` (torch 2.13's zip format), read without running their code and
without reading their tensors until asked.

    with TorchFile("mp_rank_00_model_states.pt") as f:
        module = f.content["module"]            # {key: LazyTensor or a plain value}; no tensor read yet
        w = module["decoder.final_layernorm.weight"].read()

Only tensors, plain data and ``DEEPSPEED_GLOBALS`` are admitted (``safe_load`` likewise); anything else
is ``Refused`` in one line. Format: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import collections
import importlib
import os
import pickle
import re
import zipfile
from typing import Any, Optional

import torch

from moe_plugin.checkpoint.errors import CheckpointError, first_line
from moe_plugin.checkpoint.trust import TRUST_HINT, trusted

STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                  "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                  "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                  "BoolStorage": torch.bool}
DTYPE_NAMES = {str(d).split(".")[1]: d for d in STORAGE_DTYPES.values()}
# The classes DeepSpeed 0.19 pickles into its checkpoint files besides tensors, OrderedDict and
# torch.Size: its ZeRO and bf16 optimizer files (the stage, each parameter's fragment address, the
# loss scaler: ``runtime/zero/stage_1_and_2.py``, ``runtime/bf16_optimizer.py``). Its module files
# hold none.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
                     "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")


class Refused(CheckpointError):
    """A file holding a global that no checkpoint file may hold."""


def refusal(path: str, what: str) -> Refused:
    return Refused(f"{path}: holds {what}, which no file of a checkpoint may hold ({TRUST_HINT})")


def deepspeed_classes() -> list[type]:
    """``DEEPSPEED_GLOBALS`` imported (those the installed DeepSpeed lacks are left out)."""
    out = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return out


def safe_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` admitting tensors, plain data and ``DEEPSPEED_GLOBALS`` only, claims checked first."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        TorchFile(path).close()
    if trusted():
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(deepspeed_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        raise refusal(path, found.group(1) if found else first_line(exc)) from None


# what ``unadmitted`` passes besides tensors and DEEPSPEED_GLOBALS
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size, torch.device)


def unadmitted(value: Any, where: str = "") -> Optional[str]:
    """Where ``value`` (to be saved) holds an object ``safe_load`` would refuse, and its class; or None."""
    if isinstance(value, _PLAIN) or isinstance(value, torch.Tensor) and type(value) in (torch.Tensor,
                                                                                        torch.nn.Parameter):
        return None
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            found = unadmitted(key, f"{where}[{key!r}] (its key)") or unadmitted(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple, set, frozenset):
        for i, item in enumerate(value):
            found = unadmitted(item, f"{where}[{i}]")
            if found:
                return found
        return None
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if name in DEEPSPEED_GLOBALS:
        return None
    return f"{where or 'the object'} is a {name}"


class Opaque:
    """An object of a class the table does not admit: its class name and what the pickle gave it."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<unread {self.qualname}>"


class LazyTensor:
    """A tensor of a ``TorchFile``, read by ``read`` (only its own bytes)."""

    def __init__(self, source: "TorchFile", key: str, dtype: torch.dtype, offset: int, shape: tuple, stride: tuple):
        self.source, self.key, self.dtype = source, key, dtype
        self.offset, self.shape, self.stride = offset, torch.Size(shape), tuple(stride)

    def numel(self) -> int:
        return self.shape.numel()

    def read(self) -> torch.Tensor:
        return self.source.read_tensor(self)

    def __repr__(self) -> str:
        return f"LazyTensor({self.dtype}, {list(self.shape)})"


class TorchFile:
    """One ``torch.save`` file; ``content``: the unpickled object, tensors lazy."""

    def __init__(self, path: os.PathLike | str):
        self.path = os.fspath(path)
        self.strict = not trusted()
        try:
            self._zip = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing") from None
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: unreadable torch file, truncated or damaged ({exc})") from None
        pickles = [n for n in self._zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            self._zip.close()
            raise CheckpointError(f"{self.path}: not a torch.save file (no data.pkl record)")
        self._prefix = pickles[0][:-len("data.pkl")]
        try:
            self._check_records()
            data = self._zip.read(pickles[0])
            self.content = _Unpickler(self, data).load()
        except CheckpointError:
            self._zip.close()
            raise
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError, ValueError, TypeError, IndexError,
                KeyError, AttributeError) as exc:
            self._zip.close()
            raise CheckpointError(f"{self.path}: unreadable torch file, truncated or damaged ({type(exc).__name__}: "
                                  f"{exc})") from None

    def _check_records(self) -> None:
        """Every record's stored size lies inside the file."""
        size = os.path.getsize(self.path)
        for info in self._zip.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size \
                    or info.header_offset + info.compress_size > size:
                raise CheckpointError(f"{self.path}: record {info.filename} claims {info.file_size} bytes "
                                      f"({info.compress_size} stored, compression {info.compress_type}) in a file of "
                                      f"{size}; torch.save stores its records uncompressed, inside the file")

    def storage(self, key: str, dtype: torch.dtype, numel: Any) -> tuple:
        """A storage the pickle names: its record must exist and hold ``numel`` elements of ``dtype``."""
        try:
            stored = self._zip.getinfo(self._prefix + "data/" + key).file_size
        except KeyError:
            raise CheckpointError(f"{self.path}: names storage {key!r}, which has no record (damaged)") from None
        if not _count(numel) or numel * dtype.itemsize != stored:
            raise CheckpointError(f"{self.path}: storage {key!r} claims {numel!r} elements of {dtype} "
                                  f"({_size(numel, dtype)}); its record holds {stored} bytes")
        return (self, key, dtype, numel)

    def read_tensor(self, t: LazyTensor) -> torch.Tensor:
        size = t.dtype.itemsize
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        span = _span(t.shape, t.stride)
        out = torch.empty(span, dtype=t.dtype)
        view = memoryview(out.view(torch.uint8).numpy())
        try:
            with self._zip.open(self._prefix + "data/" + t.key) as f:
                f.seek(t.offset * size)
                done = 0
                while done < len(view):
                    got = f.readinto(view[done:])
                    if not got:
                        raise EOFError("the record ends early")
                    done += got
        except (KeyError, EOFError, OSError, zipfile.BadZipFile) as exc:
            raise CheckpointError(f"{self.path}: unreadable torch file, truncated or damaged (record {t.key}: "
                                  f"{exc})") from None
        if t.numel() == span and t.stride == tuple(torch.empty(t.shape).stride()):
            return out.view(t.shape)
        return out.as_strided(t.shape, t.stride).clone()

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> "TorchFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _span(shape: tuple, stride: tuple) -> int:
    """Elements from a tensor's first to its last (one past), by its shape and stride."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def _size(numel: Any, dtype: torch.dtype) -> str:
    return f"{numel * dtype.itemsize} bytes" if _count(numel) else "not a count"


def _rebuild_tensor(storage: tuple, offset: Any, shape: Any, stride: Any, *_rest: Any) -> LazyTensor:
    """A tensor as the pickle describes it, checked against its storage before anything is reserved."""
    if not (isinstance(storage, tuple) and len(storage) == 4 and isinstance(storage[0], TorchFile)):
        raise pickle.UnpicklingError("a tensor without a storage")
    source, key, dtype, numel = storage
    if not (_count(offset) and isinstance(shape, tuple) and isinstance(stride, tuple) and len(shape) == len(stride)
            and all(map(_count, shape)) and all(map(_count, stride))):
        raise CheckpointError(f"{source.path}: a tensor of storage {key!r} has offset {offset!r}, shape {shape!r}, "
                              f"stride {stride!r}; expected counts, as many strides as sizes")
    elements = 1
    for n in shape:
        elements *= n
    if elements and offset + _span(shape, stride) > numel:
        raise CheckpointError(f"{source.path}: a tensor of storage {key!r} claims shape {list(shape)}, stride "
                              f"{list(stride)} from offset {offset}: past the storage's {numel} elements of {dtype}")
    return LazyTensor(source, key, dtype, offset, shape, stride)


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _bytes(text: str, encoding: str = "utf-8") -> bytes:
    """How a pickle of protocol 2 spells bytes: ``_codecs.encode(str, "latin1")``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode(encoding)


class _Unpickler(pickle.Unpickler):
    ADMITTED = {("collections", "OrderedDict"): collections.OrderedDict, ("torch", "Size"): torch.Size,
                ("builtins", "set"): set, ("__builtin__", "set"): set, ("builtins", "frozenset"): frozenset,
                ("__builtin__", "frozenset"): frozenset, ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter, ("_codecs", "encode"): _bytes,
                ("torch", "device"): torch.device}

    def __init__(self, source: TorchFile, data: bytes):
        import io

        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        admitted: Optional[Any] = self.ADMITTED.get((module, name))
        if admitted is not None:
            return admitted
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage", STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
        if self._source.strict and f"{module}.{name}" not in DEEPSPEED_GLOBALS:
            raise refusal(self._source.path, f"{module}.{name}")
        return type(name, (Opaque,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> tuple:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple)):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:60]}")
        if len(pid[1]) != 2 or pid[1][0] != "storage" or not isinstance(pid[1][1], torch.dtype):
            raise pickle.UnpicklingError(f"a storage of {str(pid[1])[:60]}")
        return self._source.storage(str(pid[2]), pid[1][1], pid[4])
