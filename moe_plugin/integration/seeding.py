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

Megatron-Core's RNG tracker (``seed_megatron_rng``, which ``moe_plugin.initialize`` calls before
the model provider runs) is seeded as Megatron-LM seeds it (``megatron/training/initialize.py``,
``_set_random_seed``): ``model_parallel_cuda_manual_seed(seed + 100 * pipeline rank)``, whose
data-parallel state takes that seed, the model-parallel state that + 2718 + the tensor-parallel
rank, the expert-parallel state that + 1024 + 100 * the expert-parallel rank + the expert-tensor
rank. Megatron's attention forks the model-parallel state for its dropout on every forward, its
embedding and transformer block under sequence parallelism, its tensor-parallel layers when they
initialise on the GPU (without ``use_cpu_initialization``): a model that is not seeded fails there.
On the CPU accelerator the tracker holds CPU generator states (``compat/megatron_cpu.py``).
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
    """The seed Megatron-LM gives ``model_parallel_cuda_manual_seed`` on pipeline stage ``pp_rank``
    (without ``--data-parallel-random-init``): ``seed + 100 * pp_rank``."""
    return seed + 100 * pp_rank


def seed_megatron_rng(seed: Optional[int], groups: Optional["ProcessGroups"]) -> Optional[int]:
    """Seed Megatron-Core's RNG tracker for this rank (module docstring) from ``seed`` (None:
    ``torch.initial_seed()``) and this rank's place in ``groups`` (None: one process). On the CUDA
    accelerator Megatron's own tracker; on the CPU accelerator the CPU stand-ins of
    ``compat/megatron_cpu.py`` first (a tracker over the CPU generator, sequence-parallel buffers on
    the CPU). Other accelerators: nothing. Returns the seed the tracker got, or None. Call it after
    the process groups exist and before the model is built (``moe_plugin.initialize`` does)."""
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
