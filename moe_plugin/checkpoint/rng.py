"""A rank's random streams in a checkpoint (``rng/rank_XXXXX.safetensors``), restored only where every
rank sees the tokens it saw when saving (``metadata.TOKEN_LAYOUT_KEYS``).
"""
from __future__ import annotations

import random

import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from moe_plugin.layers.router import Router

try:
    import numpy
except ImportError:  # NumPy's RNG is then neither saved nor restored
    numpy = None

RNG_KIND = "rng"


def rng_state(model: nn.Module) -> dict:
    """This rank's random streams, and every router's noise generators and pending load counts."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy.random.get_state() if numpy is not None else None, "accelerator": None, "routers": {},
             "megatron_tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()}}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        state["accelerator"] = accelerator.get_rng_state()
    for name, module in model.named_modules():
        if isinstance(module, Router):
            state["routers"][name] = {"generators": {str(d): g.get_state() for d, g in module._generators.items()},
                                      "load_E": module.load_E.detach().clone()}
    return state


def set_rng_state(model: nn.Module, state: dict) -> None:
    """The inverse of ``rng_state``."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if numpy is not None and state.get("numpy") is not None:
        numpy.random.set_state(state["numpy"])
    if state.get("accelerator") is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    if state.get("megatron_tracker"):   # (absent from checkpoints saved before it was kept)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states({name: s.clone() for name, s in state["megatron_tracker"].items()})
    for name, module in model.named_modules():
        if isinstance(module, Router) and name in state["routers"]:
            saved = state["routers"][name]
            for device, gen_state in saved["generators"].items():
                module.generator(torch.device(device)).set_state(gen_state)
            module.load_E.copy_(saved["load_E"])


def clear_pending_load(model: nn.Module) -> None:
    """Zero every router's not-yet-applied load counts (a load that restores no RNG states)."""
    for module in model.modules():
        if isinstance(module, Router):
            module.load_E.zero_()
