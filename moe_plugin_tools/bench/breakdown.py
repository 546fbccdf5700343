"""Where our MoE layer's time goes beyond the expert GEMMs: its parts timed one by one.

Shape suffixes: see ``moe_plugin.layers``.

Each part runs forward + backward alone on the same data as in the layer, through the layer's
own objects (router, dispatcher, experts), in a rotating order like the main bench:

* ``router``: logits GEMM, softmax, top-k, route argsort, bincount, capacity, balance loss,
  and their backward (through the gates and the balance loss);
* ``route_topk`` / ``route_argsort``: the two selections inside the router alone (no grad):
  ``top_k_experts`` of the [T, E] logits, ``argsort`` of the K*T route keys;
* ``permute``: ``index_select`` of the kept routes' token rows, backward an ``index_add``
  (the layer no longer runs it as such: its experts gather from the tokens, next line);
* ``experts_gathering``: the experts as the layer runs them, rows gathered from the tokens by
  ``token_R`` chunk by chunk (and again in backward), gradient ``index_add``-ed into the tokens';
* ``experts``: the grouped GEMMs on ready rows (the floor);
* ``combine``: ``gate_combine`` (a gather per token, fp32 sum; gather backward).

``experts_gathering`` + ``router`` + ``combine`` add up to about the layer (which also
attaches the aux loss and reshapes).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
from torch import Tensor

from moe_plugin.layers import MoELayer
from moe_plugin.layers.router import top_k_experts


def time_parts(layer: MoELayer, x_TH: Tensor, warmup: int = 1, iters: int = 5,
               sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median ms of each part's forward + backward (see the module docstring); the data is on
    ``x_TH``'s device and dtype, and ``sync()`` (the device's, off the CPU) brackets each part."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(x_TH.device, x_TH.dtype)

    with torch.no_grad():
        plan, finite = layer.router(x_TH)
        state = layer.dispatcher.prepare(x_TH, plan, finite)
    plan = state.plan                                     # the kept routes
    T, H = x_TH.shape
    R = plan.token_R.numel()
    x_leaf_TH = x_TH.detach().requires_grad_(True)
    x_RH = randn(R, H).requires_grad_(True)
    y_RH = randn(R, H).requires_grad_(True)
    gate_R = plan.gate_R.detach().requires_grad_(True)
    combine_state = dataclasses.replace(state, plan=dataclasses.replace(plan, gate_R=gate_R))
    grad_RH = randn(R, H)
    grad_TH = randn(T, H)
    coeff = layer.config.aux_loss_coeff
    logits_TE = layer.router.logits(x_TH.detach()).detach()
    keys = torch.randint(0, plan.num_experts + 1, (plan.k * T,), generator=gen).to(x_TH.device)

    def router() -> None:
        p, _ = layer.router(x_leaf_TH)
        (p.gate_R.sum() + coeff * p.balance_loss).backward()

    def permute() -> None:
        x_leaf_TH.index_select(0, plan.token_R).backward(grad_RH)

    def experts() -> None:
        layer.experts(x_RH, plan.kept_E).backward(grad_RH)

    def experts_gathering() -> None:
        layer.experts(x_leaf_TH, plan.kept_E, plan.token_R).backward(grad_RH)

    def combine() -> None:
        layer.dispatcher.combine(y_RH, combine_state).backward(grad_TH)

    def route_topk() -> None:
        top_k_experts(logits_TE, plan.k)

    def route_argsort() -> None:
        torch.argsort(keys, stable=True)

    parts = {"router": router, "route_topk": route_topk, "route_argsort": route_argsort, "permute": permute,
             "experts_gathering": experts_gathering, "experts": experts, "combine": combine}
    leaves = [x_leaf_TH, x_RH, y_RH, gate_R, *layer.parameters()]
    names = list(parts)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            for t in leaves:
                t.grad = None
            sync()
            start = time.perf_counter()
            parts[name]()
            sync()
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    for t in leaves:
        t.grad = None
    return {name: round(statistics.median(ms), 2) for name, ms in times.items()}
