"""Initial weights that do not depend on the layout: which seed each piece of a GPT is drawn from.

A ``GPTModel`` built with the plugin's spec draws, in this order:

* the embedding (word, then position weights) from torch's default generator as it stands, so
  call ``torch.manual_seed(seed)`` right before building the model (Megatron-LM does, DeepSpeed
  users do, the example does);
* every transformer layer under its own seed, ``layer_seed(seed, i)`` for global layer ``i``
  (``MoEAwareTransformerLayer`` forks the generator around its construction, so the stream the
  model continues with is untouched): which pipeline stage builds layer ``i`` does not matter;
* an untied output layer from the default generator, after the embedding's draws.

``pipeline.gpt_pipeline_module`` replays exactly this: the first stage draws the embedding from
``torch.manual_seed(seed)``, the last stage draws the same embedding and then the output layer
(or, tied, takes the embedding's word weight). With ``use_cpu_initialization`` Megatron draws each
full weight and cuts the tensor-parallel shard from it, so tp, pp and ep runs all start from the
weights of the one-rank ``GPTModel``.

``seed=None`` everywhere means ``torch.initial_seed()``: the seed the user last gave
``torch.manual_seed`` (which ``deepspeed.runtime.utils.set_random_seed`` and Megatron-LM's seeding
call). Without any seed every process draws its own, and the ranks would disagree.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

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
