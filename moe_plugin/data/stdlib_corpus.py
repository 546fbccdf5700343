"""The embedded corpus: the Python standard library's own source, as a Megatron indexed dataset.

    prefix = ensure_stdlib_corpus("data")     # data/stdlib-py3.11.7-4096k_text_document.{bin,idx}
    dataset = read_indexed(prefix)

Offline on every machine, and deterministic for a given Python version and stdlib files (a manifest
records the count and a SHA-256 of the tokens). Written on first use; concurrent callers take a file
lock. Which files: docs/design/data_pipeline.md.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Union

import numpy as np

from moe_plugin.data.tokenizer import ByteTokenizer

PathLike = Union[str, os.PathLike]

DEFAULT_MAX_BYTES = 4 << 20
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """The corpus's candidate files, relative to ``root`` (the stdlib), in sorted POSIX-path order."""
    root = stdlib_dir() if root is None else Path(root)
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        found.extend((Path(directory) / f).relative_to(root) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: p.as_posix())


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES, root: Optional[Path] = None) -> Iterator[tuple[str, bytes]]:
    """``(relative path, file bytes)`` in corpus order, while the total stays within ``max_bytes``."""
    root = stdlib_dir() if root is None else Path(root)
    total = 0
    for rel in stdlib_files(root):
        data = (root / rel).read_bytes()
        if not data:
            continue
        if total + len(data) > max_bytes:
            return
        total += len(data)
        yield rel.as_posix(), data


def stdlib_jsonl(path: PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The corpus as JSON lines ``{"text", "path"}`` at ``path`` (invalid UTF-8 as U+FFFD); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for rel, data in stdlib_documents(max_bytes):
                out.write(json.dumps({"text": data.decode("utf-8", errors="replace"), "path": rel}) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def corpus_prefix(cache_dir: PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Where the corpus of this Python version and size lives under ``cache_dir``."""
    version = ".".join(map(str, sys.version_info[:3]))
    return Path(cache_dir) / f"stdlib-py{version}-{max_bytes // 1024}k_text_document"


def corpus_manifest(prefix: PathLike) -> dict:
    """The manifest written with the corpus: files, tokens, SHA-256 of the tokens, Python version."""
    return json.loads(Path(f"{prefix}.json").read_text())


def ensure_stdlib_corpus(cache_dir: PathLike = "data", max_bytes: int = DEFAULT_MAX_BYTES,
                         progress: bool = True) -> Path:
    """The prefix of the stdlib corpus under ``cache_dir``, written first if it is not there yet."""
    from moe_plugin.data.indexed import indexed_exists   # Megatron-Core's dataset module, torch

    if max_bytes < 1024:
        raise ValueError(f"max_bytes: got {max_bytes}; the corpus needs at least 1024 bytes")
    prefix = corpus_prefix(cache_dir, max_bytes)
    if indexed_exists(prefix) and Path(f"{prefix}.json").exists():
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(Path(f"{prefix}.lock")):
        if not (indexed_exists(prefix) and Path(f"{prefix}.json").exists()):  # another process may have written it
            _write_corpus(prefix, max_bytes, progress)
    return prefix


def _write_corpus(prefix: Path, max_bytes: int, progress: bool) -> None:
    from moe_plugin.data.indexed import write_indexed

    tokenizer = ByteTokenizer()
    sha = hashlib.sha256()
    files: list[str] = []
    tokens_written = [0]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_bytes, unit="B", unit_scale=True, desc=f"writing {prefix.name}", file=sys.stderr)

    def documents() -> Iterator[np.ndarray]:
        for rel, data in stdlib_documents(max_bytes):
            files.append(rel)
            yield tokenizer.encode_document(data)

    def written(tokens: np.ndarray) -> None:
        sha.update(tokens.astype("<u2").tobytes())
        tokens_written[0] += tokens.size
        if bar is not None:
            bar.update(tokens.size - 1)

    try:
        write_indexed(prefix, documents(), dtype=tokenizer.dtype, on_document=written)
    finally:
        if bar is not None:
            bar.close()
    manifest = {"python": sys.version.split()[0], "stdlib": str(stdlib_dir()), "max_bytes": max_bytes,
                "documents": len(files), "tokens": tokens_written[0], "sha256": sha.hexdigest(),
                "first": files[0], "last": files[-1], "tokenizer": "bytes 0..255, end of document 256"}
    tmp = Path(f"{prefix}.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, f"{prefix}.json")


@contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
