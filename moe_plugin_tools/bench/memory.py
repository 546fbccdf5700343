"""Peak tensor memory of a function on CPU, from the profiler's allocator events.

``peak_allocated_bytes(fn)`` runs ``fn()`` once under ``torch.profiler.profile(profile_memory=True)``.
With memory profiling on, c10's CPU allocator reports every allocation (+bytes) and every free
(-bytes) to the profiler, each with a timestamp: the raw ``[memory]`` events of the Kineto result.
Sorted by time, their running sum is the tensor memory allocated since ``fn`` started, and its
maximum is the peak above the baseline (whatever was live before the call is the baseline and
is not counted). This sees everything the allocator hands out -- outputs, tensors saved for
backward, gradients, and temporaries inside an operator (workspaces, the copies a kernel makes) --
which a ``TorchDispatchMode`` that watches operator outputs would miss.

Caveats: a block allocated before the call and freed during it is not reported (c10 warns
"Memory block of unknown size was allocated before the profiling started"), so the baseline
never makes the sum dip, but the memory it returns does not offset later allocations either:
release what a previous run left (set ``.grad`` to None, drop old outputs) before measuring.
Memory not from the c10 allocator (Python objects) is not seen. Timings under the profiler are
slower: measure time and memory in separate runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes allocated by one call: the peak of the running sum, and what was still live when it
    returned (its result included: the result is released only after the profile ends)."""

    peak_bytes: int
    retained_bytes: int
    allocations: int


def memory_profile(fn: Callable[[], object]) -> MemoryProfile:
    """Run ``fn()`` once and return its allocation profile (see the module docstring)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type().name == "CPU"), key=lambda ev: ev[0])
    live = peak = allocations = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
        allocations += nbytes > 0
    return MemoryProfile(peak_bytes=peak, retained_bytes=live, allocations=allocations)


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensor memory allocated during ``fn()`` above what was live before it."""
    return memory_profile(fn).peak_bytes
