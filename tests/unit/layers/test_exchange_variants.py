"""``exchange_rules.exchange_variants``: the (exchange, overlap_chunks) pairs the exchange twins of
``test_layers_dist.py`` are generated from. One process, no ranks.

Over a grid of layouts and placement options: a pair is listed exactly when ``overlap_unfit`` and
``exchange_unfit`` let it through, and exactly when the config accepts the ``"moe"`` block with
that ``exchange`` and ``overlap_chunks``; a pair it leaves out is refused naming
``moe.overlap_chunks`` (more chunks than the layout can run) or ``moe.exchange`` (a wire format
that does not combine).
"""
from __future__ import annotations

import itertools

import pytest

from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.placement.rules import exchange_unfit, exchange_variants, overlap_unfit

MODES = ("counts", "padded", "token")


def _grid():
    """(num_experts, expert, expert_tensor, drop_tokens, placement block) whose default block (counts,
    one exchange) the config accepts."""
    placements = ({}, {"replica_budget": 1}, {"policy": "greedy"}, {"trace_file": "traces.jsonl"})
    for E, experts in ((8, (1, 2, 4, 8)), (6, (1, 3))):
        for expert, etp, drop, placement in itertools.product(experts, (1, 2), (True, False), placements):
            try:
                _block(E, expert, etp, drop, placement, "counts", 1)
            except ConfigError:   # a layout the config refuses whatever the exchange (shadows under ETP, ...)
                continue
            yield E, expert, etp, drop, placement


def _block(E, expert, etp, drop, placement, mode, chunks) -> MoEConfig:
    return MoEConfig.from_dict({"num_experts": E, "router": "switch", "drop_tokens": drop, "exchange": mode,
                                "overlap_chunks": chunks, "parallel": {"expert": expert, "expert_tensor": etp},
                                "placement": placement})


GRID = list(_grid())
GRID_IDS = [f"E{E}-ep{ep}-etp{etp}-{'drop' if drop else 'dropless'}-"
            + ("+".join(f"{k}={v}" for k, v in placement.items()) or "static") for E, ep, etp, drop, placement in GRID]


def test_grid_covers_every_rule():
    """The grid reaches a layout where each wire format runs, where overlap runs, and where none does."""
    variants = [set(exchange_variants(**_values(*point))) for point in GRID]
    assert len(GRID) > 30
    assert any(("padded", 1) in v and ("token", 1) in v and ("counts", 4) in v for v in variants)
    assert any(("token", 1) in v and ("padded", 1) not in v for v in variants)           # dropless
    assert any(("counts", 2) in v and ("token", 1) not in v for v in variants)          # shadows, policies
    assert any(v == {("counts", 1)} for v in variants)


def _values(E, expert, etp, drop, placement) -> dict:
    return dict(expert=expert, expert_tensor=etp, num_experts=E, drop_tokens=drop,
                replica_budget=placement.get("replica_budget", 0), policy=placement.get("policy", "static"),
                trace_file=placement.get("trace_file"))


@pytest.mark.parametrize("E, expert, etp, drop, placement", GRID, ids=GRID_IDS)
def test_variants_are_what_the_rules_and_the_config_allow(E, expert, etp, drop, placement):
    values = _values(E, expert, etp, drop, placement)
    variants = exchange_variants(**values)
    assert variants[0] == ("counts", 1)
    assert len(set(variants)) == len(variants)
    rule_values = {k: v for k, v in values.items() if k != "num_experts"}
    for mode, chunks in itertools.product(MODES, range(1, E + 2)):
        why_overlap = overlap_unfit(chunks, expert, etp, E)
        why = why_overlap or exchange_unfit(mode, overlap_chunks=chunks, **rule_values)
        assert ((mode, chunks) in variants) == (why is None), (mode, chunks, why)
        if why is None:
            _block(E, expert, etp, drop, placement, mode, chunks)
        else:
            key = "overlap_chunks" if why_overlap else "exchange"
            with pytest.raises(ConfigError, match=rf"^moe\.{key}: got "):
                _block(E, expert, etp, drop, placement, mode, chunks)


@pytest.mark.parametrize("values, expected", [
    (dict(expert=4, expert_tensor=1, num_experts=8, drop_tokens=True),
     [("counts", 1), ("counts", 2), ("padded", 1), ("token", 1)]),
    (dict(expert=2, expert_tensor=1, num_experts=8, drop_tokens=False),
     [("counts", 1), ("counts", 2), ("counts", 3), ("counts", 4), ("token", 1)]),
    (dict(expert=2, expert_tensor=1, num_experts=8, drop_tokens=True, replica_budget=2),
     [("counts", 1), ("counts", 2), ("counts", 3), ("counts", 4)]),
    (dict(expert=2, expert_tensor=1, num_experts=8, drop_tokens=True, trace_file="t.jsonl"),
     [("counts", 1), ("counts", 2), ("counts", 3), ("counts", 4), ("token", 1)]),
    (dict(expert=8, expert_tensor=1, num_experts=8, drop_tokens=True), [("counts", 1), ("padded", 1), ("token", 1)]),
    (dict(expert=2, expert_tensor=2, num_experts=8, drop_tokens=True), [("counts", 1)]),
    (dict(expert=1, expert_tensor=1, num_experts=8, drop_tokens=True), [("counts", 1)]),
])
def test_variants_by_hand(values, expected):
    assert exchange_variants(**values) == expected
