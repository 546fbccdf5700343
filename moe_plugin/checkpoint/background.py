"""Asynchronous saves: the state copied to host memory at the step boundary, the files written,
hashed and committed by a thread while training goes on (``save_checkpoint(..., async_save=True)``).

``Capture`` records every file a save would write as a host copy that ``torch.save`` writes to the
same bytes; ``SaveWriter`` (one per run, with a gloo group of its own) writes and commits them in a
thread, and raises a failure on every rank at the same ``poll``. Design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.checkpoint.errors import CheckpointError

logger = logging.getLogger(__name__)

_capture: contextvars.ContextVar[Optional["Capture"]] = contextvars.ContextVar("moe_plugin_capture", default=None)


# -- the copy ---------------------------------------------------------------------------------------
def host_copy(obj: Any, values_only: bool = False) -> Any:
    """A copy of ``obj`` training can no longer change, in host memory, its structure kept (shared tensors
    shared, views on their storage); ``values_only``: each tensor alone (safetensors files)."""
    memo: dict = {}
    storages: dict = {}
    _seed_tensors(obj, memo, storages, set(), values_only)
    return copy.deepcopy(obj, memo)


def _seed_tensors(obj: Any, memo: dict, storages: dict, seen: set, values_only: bool) -> None:
    """Put the host copy of every tensor in dicts, lists and tuples into deepcopy's ``memo``."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo and type(obj) in (torch.Tensor, nn.Parameter) and not obj.__dict__ \
                and obj.layout == torch.strided and not obj.is_quantized:
            memo[id(obj)] = (obj.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
                             if values_only else _tensor_copy(obj, storages))
    elif isinstance(obj, dict):
        for value in obj.values():
            _seed_tensors(value, memo, storages, seen, values_only)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _seed_tensors(value, memo, storages, seen, values_only)


def _on_host(obj: Any) -> bool:
    """Whether every tensor reachable through dicts, lists and tuples is in host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cpu"
    if isinstance(obj, dict):
        return all(_on_host(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_on_host(v) for v in obj)
    return True


def _tensor_copy(t: torch.Tensor, storages: dict) -> torch.Tensor:
    """``t`` on a CPU copy of its whole storage (one copy per storage), same offset, size, stride."""
    storage = t.untyped_storage()
    key = storage._cdata   # torch.save's own identity of a storage
    if key not in storages:
        storages[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
    with torch.no_grad():
        out = torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.size(), t.stride())
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.requires_grad and out.is_floating_point() else out


# -- capturing the files of a save ----------------------------------------------------------------
class Capture:
    """The files of one save, recorded instead of written: [(host copy, path, write function)]."""

    def __init__(self):
        self.jobs: list[tuple[Any, str, Callable[[Any, str], None]]] = []

    def record(self, obj: Any, path: str, write: Callable[[Any, str], None], values_only: bool = False,
               owned: bool = False) -> None:
        """``owned``: ``obj`` was made for this save, so it is kept as it is, not copied again."""
        self.jobs.append((obj if owned and _on_host(obj) else host_copy(obj, values_only), path, write))

    def write_all(self) -> None:
        """Write every recorded file (in the writer thread), releasing each copy once written."""
        while self.jobs:
            obj, path, write = self.jobs.pop(0)
            try:
                write(obj, path)
            except (OSError, RuntimeError, CheckpointError):   # agreed as they are (tags.saving)
                raise
            except Exception as exc:   # e.g. an object that does not pickle: agreed too, not left to one rank
                raise CheckpointError(f"{path}: {type(exc).__name__}: {exc}") from exc


def capturing() -> Optional[Capture]:
    """The capture of the save running in this thread, or None (then files are written at once)."""
    return _capture.get()


@contextlib.contextmanager
def capture_into(capture: Optional[Capture]) -> Iterator[None]:
    """Inside, ``capturing()`` returns ``capture`` (None: nothing captured)."""
    token = _capture.set(capture)
    try:
        yield
    finally:
        _capture.reset(token)


# -- the writer -----------------------------------------------------------------------------------
class SaveWriter:
    """The background writer of a run's asynchronous saves; one save at a time."""

    def __init__(self):
        self.group: Optional[dist.ProcessGroup] = None
        self.tag: Optional[str] = None
        self.path: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None

    @property
    def pending(self) -> bool:
        """A save was started and not yet waited for (the same on every rank)."""
        return self._thread is not None

    def start(self, tag: str, path: str, work: Callable[[dist.ProcessGroup], None]) -> None:
        """Run ``work(group)`` in the background (collective: every rank, no save pending)."""
        if self._thread is not None:
            raise RuntimeError("SaveWriter.start: the previous save was not waited for")
        if self.group is None:
            self.group = dist.new_group(backend="gloo")   # every rank, at the same (first) asynchronous save
        self.tag, self.path, self._error = tag, path, None
        group = self.group

        def run() -> None:
            try:
                work(group)
            except CheckpointError as err:   # agreed on every rank by tags.saving
                self._error = str(err)
            except Exception as err:   # the thread's end: whatever it was, the main thread reports it
                self._error = f"{type(err).__name__}: {err}"
                logger.exception("the background writer of checkpoint %s failed", path)

        self._thread = threading.Thread(target=contextvars.Context().run, args=(run,), daemon=False,
                                        name=f"moe_plugin-save-{tag}")
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's thread has finished (no collective)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Optional[str]:
        """Join the pending save: its tag's directory (None without one), or its ``CheckpointError``."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(error)
        return self.path

    def poll(self) -> Optional[str]:
        """Collective while a save is pending: ``wait()`` once every rank's thread is done, else None."""
        if self._thread is None:
            return None
        from deepspeed.accelerator import get_accelerator

        # the default group: the writer's own is the thread's while it runs
        flag = torch.tensor([int(self.done())], dtype=torch.int32, device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return self.wait() if int(flag.item()) else None

    def close(self) -> None:
        """Wait for a pending save (its failure logged, not raised) and destroy the writer's group."""
        try:
            self.wait()
        except CheckpointError as err:
            logger.error("%s", err)
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
