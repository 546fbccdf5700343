"""Deterministic initialisation: one seeded generator per (seed, stream, index); the index is e.g. a
*global* expert id, so that expert ``e`` gets the same weights whatever the EP size.
"""
from __future__ import annotations

from typing import Union

import torch

_MIX = 1_000_003
_MASK = (1 << 63) - 1


def seeded_generator(seed: int, stream: int, index: int = 0,
                     device: Union[str, torch.device] = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * _MIX + stream) * _MIX + index) & _MASK)
    return gen
