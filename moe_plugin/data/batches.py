"""Which samples each step trains on, and which of them each data-parallel rank takes.

    schedule = GlobalBatches(len(train), global_batch_size=16, seed=1234)
    schedule.global_batch(step)                          # 16 sample indices, the same on every rank
    schedule.micro_batch(step, dp_rank=1, dp_size=2, micro_batch_size=4, micro_step=0)

The global batch of a step depends only on (number of samples, global batch size, seed, step), not on
the layout or the micro-batch size, so runs of any layout see the same data in every step. Order and
rows: docs/design/data_pipeline.md.
"""
from __future__ import annotations

import numpy as np


class GlobalBatches:
    """The per-step global batches over ``num_samples`` samples, in seeded epochs."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 1234, shuffle: bool = True):
        if num_samples < 1 or global_batch_size < 1:
            raise ValueError(f"num_samples ({num_samples}) and global_batch_size ({global_batch_size}) must be >= 1")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epochs: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch``."""
        if epoch not in self._epochs:
            if len(self._epochs) > 2:   # batches go forward: old epochs are not needed again
                self._epochs.pop(min(self._epochs))
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) if self.shuffle
                     else np.arange(self.num_samples))
            self._epochs[epoch] = order
        return self._epochs[epoch]

    def global_batch(self, step: int) -> np.ndarray:
        """The sample indices of ``step``'s global batch (0-based step)."""
        if step < 0:
            raise ValueError(f"step: got {step}; expected >= 0")
        positions = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(positions // self.num_samples).tolist():
            mask = positions // self.num_samples == epoch
            out[mask] = self.epoch_order(epoch)[positions[mask] % self.num_samples]
        return out

    def micro_batch(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int,
                    micro_step: int = 0) -> np.ndarray:
        """The sample indices data-parallel rank ``dp_rank`` trains on at ``micro_step`` of ``step``."""
        return micro_batch_rows(self.global_batch(step), dp_rank, dp_size, micro_batch_size, micro_step)

    def epoch_of(self, step: int) -> float:
        """How many epochs the first ``step`` steps covered (for the log)."""
        return step * self.global_batch_size / self.num_samples


def micro_batch_rows(global_batch: np.ndarray, dp_rank: int, dp_size: int, micro_batch_size: int,
                     micro_step: int = 0) -> np.ndarray:
    """The rows of ``global_batch`` data-parallel rank ``dp_rank`` takes at ``micro_step``."""
    global_batch = np.asarray(global_batch)
    per_rank, rest = divmod(len(global_batch), dp_size * micro_batch_size)
    if rest or per_rank == 0:
        raise ValueError(f"global batch {len(global_batch)} is not data-parallel size {dp_size} x micro batch "
                         f"{micro_batch_size} x gradient accumulation steps")
    if not (0 <= dp_rank < dp_size and 0 <= micro_step < per_rank):
        raise ValueError(f"dp_rank {dp_rank} / micro_step {micro_step} out of range (dp_size {dp_size}, "
                         f"{per_rank} micro-steps)")
    first = (dp_rank * per_rank + micro_step) * micro_batch_size
    return global_batch[first:first + micro_batch_size]
