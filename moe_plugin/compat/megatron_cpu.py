"""megatron-core 0.16's CUDA-only RNG tracker and buffers, given CPU stand-ins on the CPU accelerator
(``integration.seeding.seed_megatron_rng`` applies them): dropout inside a fork draws from the
model-parallel state as on a GPU. Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel import random as megatron_random

# the modules whose buffers go to the current CUDA device; cpu_buffers() redirects exactly these
BUFFER_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers",
                  "megatron.core.utils", "megatron.core.models.common.embeddings.rotary_pos_embedding")


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's ``CudaRNGStatesTracker`` over torch's CPU generator (``add``, ``fork``, nested forks)."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")   # Megatron's messages
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def install_cpu_rng_tracker() -> None:
    """Make Megatron's tracker a ``CpuRNGStatesTracker``; seed it after with ``model_parallel_cuda_manual_seed``."""
    if not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as the ``BUFFER_MODULES`` see it: ``current_device()`` is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the ``BUFFER_MODULES`` see it: torch, but ``cuda`` is ``_CudaOnCpu``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)   # kept: the next lookup of torch.matmul & co. is a plain one
        return value


def cpu_buffers() -> None:
    """Point the buffers of the ``BUFFER_MODULES`` at the CPU (idempotent)."""
    for name in BUFFER_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()


def buffers_on_cpu() -> bool:
    """Whether ``cpu_buffers()`` has been applied in this process."""
    return all(isinstance(importlib.import_module(name).torch, _TorchOnCpu) for name in BUFFER_MODULES)
