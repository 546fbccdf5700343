"""Exact per-expert capacity: ``max(min_capacity, ceil(capacity_factor * k * T / E))`` with the
factor's decimal value, the same function in the layer, the reference MoE and the planner."""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from moe_plugin.configs.capacity import expert_capacity
from moe_plugin.configs.schema import MoEConfig


def test_one_point_one_of_200_tokens_over_8_experts_is_55():
    assert expert_capacity(200, 8, 2, 1.1, 0) == 55
    assert math.ceil(1.1 * 2 * 200 / 8) == 56      # what floating point made of it


def test_sweep_against_integer_arithmetic():
    """Every T in 8..2048 and factor 0.3..2.2 (written with one decimal): tenths as integers."""
    float_off = 0
    for tenths in range(3, 23):
        factor = float(f"{tenths / 10:.1f}")
        for k, E in ((1, 8), (2, 8), (2, 64)):
            for T in range(8, 2049):
                exact = -(-tenths * k * T // (10 * E))
                assert expert_capacity(T, E, k, factor, 0) == exact, (T, factor, k, E)
                float_off += math.ceil(factor * k * T / E) != exact
    assert float_off > 0      # the sweep does reach the cases floating point gets wrong


def test_min_capacity_and_exact_inputs():
    assert expert_capacity(8, 8, 1, 1.0, 4) == 4
    assert expert_capacity(200, 8, 2, Decimal("1.1"), 0) == expert_capacity(200, 8, 2, Fraction(11, 10), 0) == 55
    assert expert_capacity(200, 8, 2, 1, 0) == 50
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor"):
            expert_capacity(8, 8, 1, bad, 0)


def test_layer_reference_and_planner_use_it():
    import torch

    from moe_plugin.layers import Router, reference_moe
    from moe_plugin.planner.cost_model import expert_rows_by_expert
    from moe_plugin.planner.spec import Layout, PlanModel

    E, H, F, T = 8, 4, 8, 200
    block = {"num_experts": E, "router": "topk", "top_k": 2, "capacity_factor": 1.1, "min_capacity": 0}
    config = MoEConfig.from_dict(block)
    assert Router(config, hidden_size=H).capacity(T) == 55
    router_EH = torch.zeros(E, H)
    router_EH[0, 0], router_EH[1, 0] = 2.0, 1.0          # every token: expert 0 first, expert 1 second
    params = {"router.weight": router_EH, "experts.weight1": torch.randn(E, H, F),
              "experts.weight2": torch.randn(E, F, H)}
    ref = reference_moe(torch.ones(T, H), params, config, training=True)
    assert ref.capacities == [55] and ref.kept_per_expert[:2] == [55, 55]
    model = PlanModel.build({"train_batch_size": 2, "moe": block}, dict(num_layers=2, hidden_size=8, ffn_hidden_size=16,
                            num_attention_heads=2, vocab_size=16, seq_length=100))   # the same "moe" block
    layout = Layout(tp=1, pp=1, ep=1, etp=1, dp=1, zero=0, micro_batch=2, gas=1)
    rows = expert_rows_by_expert(model, layout, np.eye(E)[0])
    assert rows[0] == 55          # the hot expert keeps exactly the layer's capacity
