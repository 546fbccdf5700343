"""Opt-in timing of the expert GEMM backends: ``MOE_BENCH=1 pytest -s tests/test_layers_gemm_bench.py``.

4096 routes x 64 experts, H 512, F 1024, fp32, gelu FFN, forward and forward+backward:
``torch._grouped_mm`` vs a ``split``/``unbind`` loop (both ``GroupedExperts`` backends) vs
``bmm`` on a zero-padded [E, C, H] buffer with C the largest expert count (dropless).
Prints the best of a few runs per backend; asserts only that all three agree.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from moe_plugin.layers import GroupedExperts

pytestmark = pytest.mark.skipif(os.environ.get("MOE_BENCH") != "1", reason="timing run; set MOE_BENCH=1")
R, E, H, FFN = 4096, 64, 512, 1024


def padded_bmm(x_RH: torch.Tensor, counts_E: torch.Tensor, w1_EHF: torch.Tensor, w2_EFH: torch.Tensor) -> torch.Tensor:
    C = int(counts_E.max())
    start_E = torch.cumsum(counts_E, 0) - counts_E
    expert_R = torch.repeat_interleave(torch.arange(E), counts_E)
    slot_R = expert_R * C + torch.arange(x_RH.shape[0]) - start_E[expert_R]
    x_ECH = torch.index_copy(x_RH.new_zeros(E * C, H), 0, slot_R, x_RH).view(E, C, H)
    y_ECH = torch.bmm(F.gelu(torch.bmm(x_ECH, w1_EHF)), w2_EFH)
    return y_ECH.view(E * C, H).index_select(0, slot_R)


def best_ms(fn, backward: bool, repeats: int = 4) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = fn()
        if backward:
            y.backward(torch.ones_like(y))
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


@pytest.mark.parametrize("skew", [0.0, 0.5], ids=["balanced", "skewed"])
def test_time_expert_gemm_backends(skew):
    gen = torch.Generator().manual_seed(0)
    expert_R = torch.multinomial(torch.softmax(torch.randn(E, generator=gen) * skew, 0), R, True, generator=gen)
    counts_E = torch.bincount(expert_R, minlength=E)
    x_RH = torch.randn(R, H, generator=gen, requires_grad=True)
    experts = {b: GroupedExperts(E, H, FFN, "gelu", backend=b) for b in ("grouped_mm", "loop")}
    runs = {name: (lambda m=m: m(x_RH, counts_E)) for name, m in experts.items()}
    runs["padded bmm"] = lambda: padded_bmm(x_RH, counts_E, experts["loop"].weight1, experts["loop"].weight2)
    with torch.no_grad():
        outs = [fn() for fn in runs.values()]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-4, rtol=1e-4)
    print(f"\n{skew=} counts min {int(counts_E.min())} max {int(counts_E.max())}, {torch.get_num_threads()} threads")
    for name, fn in runs.items():
        with torch.no_grad():
            fwd = best_ms(fn, backward=False)
        print(f"  {name:11s} forward {fwd:8.1f} ms   forward+backward {best_ms(fn, backward=True):8.1f} ms")
