"""GPT training samples: windows of ``seq_length + 1`` tokens over a stream of documents.

    train_docs, valid_docs = split_documents(num_documents(dataset), valid_fraction=0.05)
    train = TokenSamples(dataset, train_docs, seq_length=128)
    tokens_BS, labels_BS = train.batch([0, 7, 3])       # int64 tensors [3, 128]

Consecutive samples share one token; windows cross document boundaries, as in Megatron's
``GPTDataset``. The validation split is every ``1/f``-th document, deterministic. Details:
docs/design/data_pipeline.md.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset

from moe_plugin.data.indexed import document_sequences


def split_documents(num_documents: int, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training document ids, validation document ids), both sorted."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction: got {valid_fraction}; expected a fraction in [0, 1)")
    if num_documents < 1:
        raise ValueError(f"num_documents: got {num_documents}; the dataset has no documents")
    d = np.arange(num_documents)
    held_out = np.floor((d + 1) * valid_fraction) > np.floor(d * valid_fraction)
    return d[~held_out], d[held_out]


class TokenSamples:
    """Samples of ``seq_length + 1`` tokens over the concatenated ``documents`` of ``dataset``."""

    def __init__(self, dataset: IndexedDataset, documents: Sequence[int], seq_length: int, name: str = "samples"):
        if seq_length < 1:
            raise ValueError(f"seq_length: got {seq_length}; expected >= 1")
        self.dataset = dataset
        self.seq_length = seq_length
        self.name = name
        self.sequences = document_sequences(dataset, np.asarray(documents, dtype=np.int64))
        lengths = dataset.sequence_lengths[self.sequences].astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])   # stream offset of each sequence
        self.num_tokens = int(self.starts[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // seq_length)
        if self.num_samples == 0:
            raise ValueError(f"{name}: {self.num_tokens} tokens in {len(documents)} documents do not make one sample "
                             f"of seq_length + 1 = {seq_length + 1} tokens; use more data or a shorter --seq-length")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample ``index``: ``seq_length + 1`` token ids (int64)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.name}: sample {index} out of range 0..{self.num_samples - 1}")
        begin = index * self.seq_length
        end = begin + self.seq_length + 1
        pieces = []
        k = int(np.searchsorted(self.starts, begin, side="right")) - 1
        while begin < end:
            offset = begin - int(self.starts[k])
            length = min(end, int(self.starts[k + 1])) - begin
            if length > 0:
                pieces.append(self.dataset.get(int(self.sequences[k]), offset=offset, length=length))
                begin += length
            k += 1
        return np.concatenate(pieces).astype(np.int64)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens_BS, labels_BS)`` for the samples ``indices``: int64 tensors [len(indices), S]."""
        rows = np.stack([self[int(i)] for i in indices])
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def masked_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``batch`` with a loss mask: 1 everywhere but on the rows of index -1 (``packing.EMPTY``)."""
        real_B = torch.tensor([int(i) >= 0 for i in indices])
        rows = np.zeros((len(indices), self.seq_length + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            if int(i) >= 0:
                rows[row] = self[int(i)]
        data = torch.from_numpy(rows)
        mask_BS = real_B[:, None].expand(-1, self.seq_length).float()
        return data[:, :-1].contiguous(), data[:, 1:].contiguous(), mask_BS
