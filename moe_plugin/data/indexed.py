"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and written with Megatron-Core's
own ``megatron.core.datasets.indexed_dataset``, so Megatron-LM's preprocessed data and this package's
are interchangeable.

    write_indexed("data/corpus_text_document", documents, dtype=np.uint16)
    dataset = read_indexed("data/corpus_text_document")     # an IndexedDataset
    dataset[3]                                               # sequence 3 as a numpy array

A write appears under the final names only when complete (the ``.idx`` last). A read first checks the
pair against what the index promises: a damaged file is a ``ConfigError`` naming the file, the value
found and the one expected. The checks: docs/design/data_pipeline.md.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from moe_plugin.configs.errors import ConfigError

PathLike = Union[str, os.PathLike]
# Megatron's .idx: magic, version <Q (1), token type code <B, sequence count <Q, document count <Q,
# then int32 lengths [sequences], int64 byte offsets into the .bin [sequences], int64 document
# bounds [documents].
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = struct.Struct("<9sQBQQ")
_CHUNK = 1 << 22   # sequences checked at a time: memory stays small on billion-token indexes


def indexed_exists(prefix: PathLike) -> bool:
    """Whether both ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    return IndexedDataset.exists(str(prefix))


def read_indexed(prefix: PathLike, mmap: bool = True) -> IndexedDataset:
    """Open ``PREFIX.{bin,idx}``; a ``FileNotFoundError`` names what is missing."""
    prefix = str(prefix)
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"indexed dataset {prefix!r}: {' and '.join(missing)} not found; pass the prefix "
                                "without .bin/.idx, e.g. data/my-corpus_text_document (Megatron's preprocess_data "
                                "writes <output-prefix>_text_document.bin/.idx)")
    check_indexed(prefix)
    return IndexedDataset(prefix, mmap=mmap)


def check_indexed(prefix: PathLike) -> int:
    """Check ``PREFIX.idx`` and ``PREFIX.bin`` against each other; returns the number of tokens."""
    idx, bin_ = get_idx_path(str(prefix)), get_bin_path(str(prefix))
    found = os.path.getsize(idx)
    if found < IDX_HEADER.size:
        raise ConfigError(idx, found, f"expected at least {IDX_HEADER.size} bytes (the header of Megatron's indexed "
                          "format): the file is empty or truncated", shown=f"{found:,} bytes")
    with open(idx, "rb") as stream:
        magic, version, code, S, D = IDX_HEADER.unpack(stream.read(IDX_HEADER.size))
    if magic != IDX_MAGIC:
        raise ConfigError(idx, magic, f"expected the header {IDX_MAGIC!r} of Megatron's indexed format: not an index "
                          "file", shown=f"header {magic!r}")
    codes = {t.value: t.name for t in DType}
    if version != 1 or code not in codes:
        raise ConfigError(idx, (version, code), f"expected version 1 and a token type code among "
                          f"{', '.join(f'{c} ({n})' for c, n in sorted(codes.items()))}",
                          shown=f"version {version}, token type code {code}")
    expected = IDX_HEADER.size + 12 * S + 8 * D
    if found != expected:
        raise ConfigError(idx, found, f"expected {expected:,}: its header promises {S:,} sequences and {D:,} document "
                          "bounds; the file is truncated or garbage", shown=f"{found:,} bytes")
    if S == 0 or D < 2:
        raise ConfigError(idx, S, "expected at least one document of at least one sequence",
                          shown=f"{S:,} sequences in {max(D - 1, 0):,} documents")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=IDX_HEADER.size, shape=(S,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=IDX_HEADER.size + 4 * S, shape=(S,))
    bounds = np.memmap(idx, dtype=np.int64, mode="r", offset=IDX_HEADER.size + 12 * S, shape=(D,))
    if bounds[0] != 0 or bounds[-1] != S or np.any(np.diff(bounds) < 0):
        raise ConfigError(idx, (int(bounds[0]), int(bounds[-1])), f"expected document bounds rising from 0 to the "
                          f"{S:,} sequences: the index is garbage",
                          shown=f"document bounds {int(bounds[0]):,}..{int(bounds[-1]):,}")
    itemsize = np.dtype(getattr(np, codes[code])).itemsize
    offset = 0   # the .bin offset of the next sequence, in bytes
    for first in range(0, S, _CHUNK):
        part = np.asarray(lengths[first:first + _CHUNK], dtype=np.int64)
        if part.min() < 0:
            raise ConfigError(idx, int(part.min()), "expected sequence lengths >= 0: the index is garbage",
                              shown=f"length {int(part.min())}")
        starts = offset + np.concatenate([[0], np.cumsum(part[:-1])]) * itemsize
        wrong = np.flatnonzero(np.asarray(pointers[first:first + _CHUNK]) != starts)
        if wrong.size:
            i = int(wrong[0])
            raise ConfigError(idx, int(pointers[first + i]), f"expected {int(starts[i]):,}, the sum of the lengths "
                              "before it: the index is garbage", shown=f"byte offset {int(pointers[first + i]):,} "
                              f"of sequence {first + i:,}")
        offset = int(starts[-1]) + int(part[-1]) * itemsize
    found = os.path.getsize(bin_)
    if found != offset:
        state = "truncated" if found < offset else "longer"
        raise ConfigError(bin_, found, f"expected {offset:,}: {idx} lists {offset // itemsize:,} {codes[code]} tokens "
                          f"in {S:,} sequences; the file is {state} or belongs to another index",
                          shown=f"{found:,} bytes")
    return offset // itemsize


class IndexedWriter:
    """Writes ``PREFIX.{bin,idx}`` one document at a time (``add``), under temporary names until
    ``commit`` renames them (the ``.idx`` last); leaving the ``with`` block without it removes them."""

    def __init__(self, prefix: PathLike, dtype: type = np.uint16):
        self.prefix = str(prefix)
        self.dtype = dtype
        self.documents = 0
        self.tokens = 0
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp = f"{self.prefix}.tmp{os.getpid()}"
        self._builder = IndexedDatasetBuilder(get_bin_path(self._tmp), dtype=dtype)

    def add(self, tokens: np.ndarray) -> None:
        """Append one document (a non-empty 1-D array of token ids that fit ``dtype``)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"document {self.documents}: expected a non-empty 1-D array of token ids, got shape "
                             f"{tokens.shape}")
        info = np.iinfo(self.dtype)
        if tokens.min() < info.min or tokens.max() > info.max:
            raise ValueError(f"document {self.documents}: token ids {tokens.min()}..{tokens.max()} do not fit "
                             f"{self.dtype.__name__}")
        self._builder.add_item(torch.from_numpy(tokens.astype(self.dtype, copy=False).astype(np.int64)))
        self._builder.end_document()
        self.documents += 1
        self.tokens += tokens.size

    def commit(self) -> None:
        """Finish the index and rename both files into place (the ``.idx`` last)."""
        if self.documents == 0:
            raise ValueError(f"no documents to write to {self.prefix!r}")
        self._builder.finalize(get_idx_path(self._tmp))
        os.replace(get_bin_path(self._tmp), get_bin_path(self.prefix))
        os.replace(get_idx_path(self._tmp), get_idx_path(self.prefix))

    def close(self) -> None:
        """Close the file and remove what ``commit`` did not rename (safe to call twice)."""
        self._builder.data_file.close()
        for path in (get_bin_path(self._tmp), get_idx_path(self._tmp)):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_indexed(prefix: PathLike, documents: Iterable[np.ndarray], dtype: type = np.uint16,
                  on_document: Optional[Callable[[np.ndarray], None]] = None) -> IndexedDataset:
    """Write ``documents`` (1-D integer arrays) to ``PREFIX.{bin,idx}`` as ``dtype`` and open it."""
    with IndexedWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add(tokens)
            if on_document is not None:
                on_document(np.asarray(tokens))
        writer.commit()
    return IndexedDataset(str(prefix))


def document_sequences(dataset: IndexedDataset, documents: np.ndarray) -> np.ndarray:
    """The sequence indices of ``documents`` (document ids, in the given order), concatenated."""
    bounds = dataset.document_indices
    parts = [np.arange(bounds[d], bounds[d + 1]) for d in np.asarray(documents).tolist()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def num_documents(dataset: IndexedDataset) -> int:
    return len(dataset.document_indices) - 1
