"""Where a bench runs: ``--device`` and ``--dtype`` of ``bench layer`` and ``bench step``.

The default device is DeepSpeed's accelerator's (``get_accelerator().device_name()``: ``cpu``
on a machine without an accelerator, ``cuda`` with NVIDIA GPUs); nothing defaults to CUDA.
On a device other than the CPU, kernels run asynchronously: ``Target.sync()`` (the
accelerator's ``synchronize``) brackets every timed region, and peak memory is the
accelerator's ``max_memory_allocated`` above what was allocated before (``memory_profile``);
on the CPU it is the profiler's allocator events (``memory.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from moe_plugin_tools.bench.memory import MemoryProfile
from moe_plugin_tools.bench.memory import memory_profile as cpu_memory_profile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def accelerator() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def check_device(name: Optional[str]) -> str:
    """``name`` (default: the accelerator's device type) when this machine has it; else a
    ``ValueError`` naming ``--device`` (one line, exit status 2 through the CLI)."""
    name = name or accelerator().device_name()
    kind = torch.device(name).type
    if kind == "cpu":
        return name
    module = getattr(torch, kind, None)
    if module is None or not module.is_available():
        raise ValueError(f"--device {name}: torch finds no {kind} device on this machine "
                         f"(DeepSpeed's accelerator here is {accelerator().device_name()!r})")
    return name


@dataclass(frozen=True)
class Target:
    """A device and dtype to run on (picklable: spawned ranks get it)."""

    device: str = "cpu"
    dtype: str = "fp32"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def on_cpu(self) -> bool:
        return self.torch_device.type == "cpu"

    def sync(self) -> None:
        """Wait for the device's queued work (nothing on the CPU)."""
        if not self.on_cpu:
            accelerator().synchronize()

    def reset_peak(self) -> None:
        if not self.on_cpu:
            accelerator().reset_peak_memory_stats()

    def peak_bytes(self) -> Optional[int]:
        """Bytes allocated on the device at the peak since ``reset_peak`` (None on the CPU)."""
        return None if self.on_cpu else accelerator().max_memory_allocated()

    def memory_profile(self, fn: Callable[[], object]) -> MemoryProfile:
        """Peak and retained bytes of ``fn()`` above what was allocated before it."""
        if self.on_cpu:
            return cpu_memory_profile(fn)
        acc = accelerator()
        self.sync()
        acc.reset_peak_memory_stats()
        base = acc.memory_allocated()
        result = fn()
        self.sync()
        profile = MemoryProfile(peak_bytes=acc.max_memory_allocated() - base,
                                retained_bytes=acc.memory_allocated() - base, allocations=0)
        del result
        return profile


def distributed_backend(rank: int) -> str:
    """Off the CPU: this rank's device is ``LOCAL_RANK`` (else the rank itself: spawned ranks on
    one machine), and the backend DeepSpeed's accelerator names (nccl on CUDA)."""
    acc = accelerator()
    acc.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return acc.communication_backend_name()


def target_from_args(args: Any) -> Target:
    return Target(device=check_device(args.device), dtype=args.dtype)
