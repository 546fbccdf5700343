"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and written with
Megatron-Core's own ``megatron.core.datasets.indexed_dataset``.

    write_indexed("data/corpus_text_document", documents, dtype=np.uint16)
    dataset = read_indexed("data/corpus_text_document")     # an IndexedDataset
    dataset[3]                                               # sequence 3 as a numpy array

So data preprocessed with Megatron-LM's ``tools/preprocess_data.py`` (which writes
``<output-prefix>_text_document.{bin,idx}``) can be given to the example as it is, and the
example's own corpus can be read by Megatron's tools.

In Megatron's format a *document* is a run of *sequences* (``document_indices``; one sequence
per document unless the preprocessing split sentences). ``write_indexed`` writes one sequence
per document. It writes under temporary names and renames them into place at the end, the
``.idx`` last, so a reader never sees a half-written dataset and an interrupted write leaves
no file under the final names.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

PathLike = Union[str, os.PathLike]


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
    return IndexedDataset(prefix, mmap=mmap)


def write_indexed(prefix: PathLike, documents: Iterable[np.ndarray], dtype: type = np.uint16,
                  on_document: Optional[Callable[[np.ndarray], None]] = None) -> IndexedDataset:
    """Write ``documents`` (1-D integer arrays, one sequence each) to ``PREFIX.{bin,idx}`` and open it.

    ``dtype``: the token dtype on disk (``DType.optimal_dtype(vocab_size)`` in Megatron's tools:
    uint16 below 65,500 tokens, else int32). ``on_document(tokens)`` is called after each
    document is written (a progress display). Files appear under their final names only when
    everything is written.
    """
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
    try:
        count = 0
        for tokens in documents:
            tokens = np.asarray(tokens)
            if tokens.ndim != 1 or tokens.size == 0:
                raise ValueError(f"document {count}: expected a non-empty 1-D array of token ids, got shape "
                                 f"{tokens.shape}")
            if tokens.min() < np.iinfo(dtype).min or tokens.max() > np.iinfo(dtype).max:
                raise ValueError(f"document {count}: token ids {tokens.min()}..{tokens.max()} do not fit {dtype.__name__}")
            builder.add_item(torch.from_numpy(tokens.astype(dtype, copy=False).astype(np.int64)))
            builder.end_document()
            count += 1
            if on_document is not None:
                on_document(tokens)
        if count == 0:
            raise ValueError(f"no documents to write to {prefix!r}")
        builder.finalize(get_idx_path(tmp))
        os.replace(get_bin_path(tmp), get_bin_path(prefix))
        os.replace(get_idx_path(tmp), get_idx_path(prefix))
    finally:
        builder.data_file.close()
        for path in (get_bin_path(tmp), get_idx_path(tmp)):
            if os.path.exists(path):
                os.remove(path)
    return IndexedDataset(prefix)


def document_sequences(dataset: IndexedDataset, documents: np.ndarray) -> np.ndarray:
    """The sequence indices of ``documents`` (document ids, in the given order), concatenated."""
    bounds = dataset.document_indices
    parts = [np.arange(bounds[d], bounds[d + 1]) for d in np.asarray(documents).tolist()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def num_documents(dataset: IndexedDataset) -> int:
    return len(dataset.document_indices) - 1
