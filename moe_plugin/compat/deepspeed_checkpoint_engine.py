"""What an asynchronous save and a safe load rely on in DeepSpeed 0.19.8's checkpoint engine: every
file of DeepSpeed's goes through ``engine.checkpoint_engine``, so files can be recorded instead of
written, loaded without running code, and a failed recovery-script copy held until the save's last
barrier. Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from moe_plugin.compat.deepspeed_checkpoint import is_recovery_script


class RecordingCheckpointEngine:
    """DeepSpeed's checkpoint engine ``inner`` with ``save`` replaced by ``record(state_dict, path)``."""

    def __init__(self, inner: Any, record: Callable[[Any, str], None]):
        self.inner = inner
        self.record = record

    def save(self, state_dict: Any, path: str) -> None:
        self.record(state_dict, path)

    def __getattr__(self, name: str) -> Any:   # create, commit, makedirs, load, preserves_storage_sharing...
        return getattr(self.inner, name)


def checkpoint_engine(engine: Any) -> Any:
    """The checkpoint engine DeepSpeed writes ``engine``'s files with."""
    return engine.checkpoint_engine


def intercepts(engine: Any) -> bool:
    """Whether ``recording_checkpoint_engine`` can stand in for ``engine``'s checkpoint engine."""
    inner = engine.checkpoint_engine
    return inner is not None and not isinstance(inner, RecordingCheckpointEngine) and not inner.is_decoupled()


@contextlib.contextmanager
def recording_checkpoint_engine(engine: Any, record: Callable[[Any, str], None]) -> Iterator[Any]:
    """Inside, ``engine.save_checkpoint`` hands its files to ``record``; yields the engine it replaced."""
    inner = engine.checkpoint_engine
    if not intercepts(engine):
        raise RuntimeError(f"asynchronous save: DeepSpeed's checkpoint engine {type(inner).__name__} is not one "
                           "that writes each file in save() (use the default TorchCheckpointEngine)")
    engine.checkpoint_engine = RecordingCheckpointEngine(inner, record)
    try:
        yield inner
    finally:
        engine.checkpoint_engine = inner


@contextlib.contextmanager
def copying_recovery_scripts(engine: Any, on_error: Callable[[OSError], None]) -> Iterator[None]:
    """Inside, an ``OSError`` of ``engine``'s recovery-script copy goes to ``on_error`` instead of raising."""
    copy = engine._copy_recovery_script

    def copying(save_path: str) -> None:
        try:
            copy(save_path)
        except OSError as err:   # the scripts, one maybe cut short, removed: the next save copies them again
            for name in os.listdir(save_path):
                if is_recovery_script(name):
                    os.remove(os.path.join(save_path, name))
            on_error(err)

    engine._copy_recovery_script = copying
    try:
        yield
    finally:
        del engine._copy_recovery_script


class SafeReadingCheckpointEngine:
    """DeepSpeed's checkpoint engine ``inner`` with ``load`` through ``torch_files.safe_load``."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        from moe_plugin.compat.torch_files import safe_load

        return safe_load(path, map_location=map_location)


@contextlib.contextmanager
def reading_safely(engine: Any) -> Iterator[None]:
    """Inside, ``engine.load_checkpoint`` reads DeepSpeed's files through ``safe_load``."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = SafeReadingCheckpointEngine(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
