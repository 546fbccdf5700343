"""What an asynchronous save and a safe load rely on in DeepSpeed 0.19.8's checkpoint engine
(``runtime/checkpoint_engine``).

``engine.save_checkpoint`` writes every file of its own (module states, optimizer and ZeRO
partitions; a ``PipelineEngine``'s layer files through ``PipelineModule.save_state_dict``) with
``engine.checkpoint_engine.save(state_dict, path)``, and only creates directories, copies its
``zero_to_*.py`` recovery scripts and calls ``create`` / ``commit`` besides (``commit`` writes
nothing with the default ``TorchCheckpointEngine``). ``recording_checkpoint_engine`` swaps in an
engine that hands each ``(state_dict, path)`` to a callback instead of writing it, and delegates
everything else to the engine it replaces, whose ``save`` then writes the file later (the bytes
are those a direct save writes: the same serializer and its options). ``engine.load_checkpoint``
reads every file of its own with ``engine.checkpoint_engine.load(path, map_location)`` (module and
optimizer files; the ``PipelineEngine``'s module through ``load_state_dir``, handed that same engine):
``reading_safely`` swaps in one whose ``load`` runs no code from the file (``torch_files.safe_load``).
The recovery scripts are copied by rank 0 alone, in the middle of the save (``_save_zero_checkpoint``
calls ``_copy_recovery_script(save_path)``): ``copying_recovery_scripts`` hands an ``OSError`` there (no
space left) to a callback instead of raising it, so that rank 0 still reaches the save's last barrier
(the scripts, one maybe cut short, are removed).

``tests/test_compat_guards.py`` checks the attribute and the methods against the installed DeepSpeed.
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
    """Whether ``recording_checkpoint_engine`` can stand in for ``engine``'s checkpoint engine (one
    that writes each file in ``save``, such as the default ``TorchCheckpointEngine``)."""
    inner = engine.checkpoint_engine
    return inner is not None and not isinstance(inner, RecordingCheckpointEngine) and not inner.is_decoupled()


@contextlib.contextmanager
def recording_checkpoint_engine(engine: Any, record: Callable[[Any, str], None]) -> Iterator[Any]:
    """Inside, ``engine.save_checkpoint`` hands its files to ``record`` instead of writing them;
    yields the engine it replaced (whose ``save`` writes one of them)."""
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
    """Inside, ``engine``'s copy of its ``zero_to_*.py`` recovery scripts hands an ``OSError`` to
    ``on_error`` instead of raising it (module docstring); the engine's own method again after."""
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
    """Inside, ``engine.load_checkpoint`` reads every file of DeepSpeed's through ``safe_load``: a
    global other than the tensors, plain data and the classes DeepSpeed writes is refused in one line
    naming the file (its ``TorchCheckpointEngine.load`` is ``torch.load(weights_only=False)``)."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = SafeReadingCheckpointEngine(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
