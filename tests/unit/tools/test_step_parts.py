"""``step_parts``: a step's time attributed to the parts of the model, backward included (one
process; the 2-rank case with the real GPT-MoE is in test_bench_step.py)."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from moe_plugin_tools.bench.step_parts import PARTS, parts_ms, scoped_step, table


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: only backward attribution can put that time in a part."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SelfAttention(nn.Module):   # the class names StepParts knows
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return _SlowBackward.apply(self.proj(x), 0.03)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.01)
        return self.fc(x)


def test_forward_and_backward_land_in_their_parts():
    model = nn.Sequential(SelfAttention(), MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step():
        time.sleep(0.005)
        optimizer.step()

    parts = parts_ms(model, scoped_step(lambda: model(x).sum(), lambda loss: loss.backward(), step), steps=2)
    assert set(parts) == {*PARTS, "total"}
    assert parts["attention"] >= 30 and parts["mlp"] >= 10, parts     # the sleeps, per step
    assert parts["attention"] < 60 and parts["mlp"] < 25, parts
    assert parts["optimizer"] >= 5, parts
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], rel=0.02)
    assert all(parts[p] == 0 for p in PARTS if p.startswith("moe")), parts
    # the scopes are gone afterwards
    assert not model[0]._forward_pre_hooks and not model[1]._forward_hooks


def test_table():
    text = table({"a": {"attention": 1.0, "total": 3.0}, "b": {"mlp": 2.25, "total": 2.25}})
    assert text.splitlines() == ["| part | a | b |", "|---|---:|---:|", "| attention | 1.0 | 0.0 |",
                                 "| mlp | 0.0 | 2.2 |", "| total | 3.0 | 2.2 |"]
