"""Initial weights that do not depend on the layout, and Megatron's RNG tracker seeded as Megatron-LM seeds it.

Embedding and output layer draw from torch's generator after ``torch.manual_seed(seed)``; layer ``i`` under
``layer_seed(seed, i)`` on any stage; ``seed=None``: ``torch.initial_seed()``. docs/design/integration_megatron.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups

_SEED_RANGE = 2 ** 63   # torch.manual_seed takes 64-bit values; stay clear of the sign bit


def resolve_seed(seed: Optional[int]) -> int:
    """``seed``, or the seed of torch's default generator when None."""
    return int(torch.initial_seed() if seed is None else seed) % _SEED_RANGE


def layer_seed(seed: int, layer_index: int) -> int:
    """The seed transformer layer ``layer_index`` (global, 0-based) is built under."""
    return (seed * 1_000_003 + 7_919 * (layer_index + 1)) % _SEED_RANGE


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Torch's CPU generator seeded with ``seed`` inside, the caller's state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def megatron_rng_seed(seed: int, pp_rank: int) -> int:
    """The seed Megatron-LM gives ``model_parallel_cuda_manual_seed`` on stage ``pp_rank``: ``seed + 100 * pp_rank``."""
    return seed + 100 * pp_rank


def seed_megatron_rng(seed: Optional[int], groups: Optional["ProcessGroups"]) -> Optional[int]:
    """Seed Megatron's RNG tracker from ``seed`` and this rank's place in ``groups`` (None: one process), on the CUDA
    or (over CPU generators) the CPU accelerator; returns the tracker's seed (None elsewhere). Before the model."""
    from deepspeed.accelerator import get_accelerator
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device = get_accelerator().device_name()
    if device not in ("cpu", "cuda"):
        return None
    if device == "cpu":
        from moe_plugin.compat.megatron_cpu import cpu_buffers, install_cpu_rng_tracker

        install_cpu_rng_tracker()
        cpu_buffers()
    rank = (lambda kind: 0) if groups is None else groups.rank_in
    tracker_seed = megatron_rng_seed(resolve_seed(seed), rank("pp"))
    model_parallel_cuda_manual_seed(tracker_seed, tp_rank=rank("tp"), ep_rank=rank("ep"), etp_rank=rank("etp"))
    return tracker_seed
