"""Opt-in timing of the expert GEMM backends: ``MOE_BENCH=1 pytest -s tests/unit/layers/test_layers_gemm_bench.py``.

4096 routes, H 512, F 1024, gelu FFN, forward and forward+backward, 8 and 64 experts, fp32 and
bf16 (input and weights), balanced and skewed counts: the three ``GroupedExperts`` backends,
``grouped_mm``, ``bmm`` (rows padded per expert to the largest count) and ``loop`` (``split``
views). ``MOE_BENCH_ROUTES`` sets another number of routes. Prints the best of 8 runs per
backend, the backends taken in turns; asserts only that all three agree. Figures:
docs/benchmarks_history.md, "Expert GEMM backends".
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from moe_plugin.layers import GroupedExperts

pytestmark = pytest.mark.skipif(os.environ.get("MOE_BENCH") != "1", reason="timing run; set MOE_BENCH=1")
R, H, FFN = int(os.environ.get("MOE_BENCH_ROUTES", 4096)), 512, 1024
BACKENDS = ("grouped_mm", "bmm", "loop")


def best_ms(runs: dict, backward: bool, repeats: int = 8) -> dict[str, float]:
    """The best time of each run in ms, the runs taken in turns (a busy spell slows all alike)."""
    times = {name: [] for name in runs}
    for _ in range(repeats + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                y = fn()
                if backward:
                    y.backward(torch.ones_like(y))
            times[name].append(time.perf_counter() - start)
    return {name: min(t[1:]) * 1e3 for name, t in times.items()}


@pytest.mark.parametrize("skew", [0.0, 0.5], ids=["balanced", "skewed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("E", [8, 64])
def test_time_expert_gemm_backends(E, dtype, skew):
    gen = torch.Generator().manual_seed(0)
    expert_R = torch.multinomial(torch.softmax(torch.randn(E, generator=gen) * skew, 0), R, True, generator=gen)
    counts_E = torch.bincount(expert_R, minlength=E)
    x_RH = torch.randn(R, H, generator=gen).to(dtype).requires_grad_(True)
    experts = {b: GroupedExperts(E, H, FFN, "gelu", backend=b).to(dtype) for b in BACKENDS}

    def step(m: GroupedExperts) -> torch.Tensor:
        m.zero_grad(set_to_none=True)   # as a training step starts: no gradient accumulated
        x_RH.grad = None
        return m(x_RH, counts_E)

    runs = {b: (lambda m=m: step(m)) for b, m in experts.items()}
    with torch.no_grad():
        outs = [fn() for fn in runs.values()]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **tol)
    print(f"\nE {E} {dtype} {skew=} counts min {int(counts_E.min())} max {int(counts_E.max())}, "
          f"{torch.get_num_threads()} threads")
    fwd, both = best_ms(runs, backward=False), best_ms(runs, backward=True)
    for name in runs:
        print(f"  {name:10s} forward {fwd[name]:8.1f} ms   forward+backward {both[name]:8.1f} ms")
