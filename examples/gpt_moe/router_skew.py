"""``--router-skew S``: a Zipf-like expert load made on purpose, for placement experiments.

    skew_routers(model, 1.0)             # on the built model, before the engine sees it
    freeze_routers(model)                # optional: the router weights stay at their init

Every MoE layer's router gets a fixed per-expert offset on the logits it chooses experts by:

    offset[e] = -S * sigma * log(1 + e)      (expert 0 hottest, then 1, 2, ...)

with ``sigma`` the spread of the router's logits at init (the mean norm of its weight rows: the
logit standard deviation for unit-variance inputs, ``init_std * sqrt(H)``), so S means the same
for every model size. It is written into ``Router.expert_bias``, the bias that only the expert
*choice* sees (the gate values still come from the unbiased softmax, see ``layers/router.py``),
identical on every rank (the router weight is). If the logits were Gumbel noise of scale
``sigma``, expert e would be chosen with probability proportional to ``(1 + e) ** -S``: a Zipf
law of exponent S. The real logits are closer to Gaussian, so the load is only Zipf-like; look
at it (the gate trace, the progress line's expert imbalance) to pick S.

Under the static placement (expert e on EP rank ``e // (E / EP)``) the hot experts share rank 0,
which is exactly the case load-adaptive placement is for. The offset stays fixed while the
router weight trains, unless aux-loss-free balancing (``moe.bias_update_rate`` > 0) moves it;
the router weight itself learns: measured on the placement experiment's GPT, the balance loss
(``aux_loss_coeff`` 0.1) evens a skewed load out within ~20 steps, and without it the load
collapses onto one or two experts within ~10. ``--freeze-router`` (``freeze_routers``) keeps the
router weights at their init (``requires_grad`` off before the engine is built), so the load
is the one made here, moved only by the slower drift of the hidden states.
"""
from __future__ import annotations

import math

import torch

from moe_plugin import MoELayer


def zipf_offsets(num_experts: int, skew: float, sigma: float = 1.0) -> torch.Tensor:
    """[E] ``-skew * sigma * log(1 + e)``."""
    if not math.isfinite(skew) or skew < 0:
        raise ValueError(f"--router-skew must be a finite number >= 0, got {skew}")
    return -skew * sigma * torch.log1p(torch.arange(num_experts, dtype=torch.float32))


def skew_routers(model: torch.nn.Module, skew: float) -> int:
    """Set every MoE layer's router offset (module docstring); returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    with torch.no_grad():
        for layer in layers:
            bias = layer.router.expert_bias
            sigma = layer.router.weight.detach().float().norm(dim=1).mean().item()
            bias.copy_(zipf_offsets(bias.numel(), skew, sigma).to(bias))
    return len(layers)


def freeze_routers(model: torch.nn.Module) -> int:
    """Stop training every MoE layer's router weight; returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.router.weight.requires_grad_(False)
    return len(layers)
