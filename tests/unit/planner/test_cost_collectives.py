"""The collectives the cost model charges for an MoE layer are the ones the layer runs.

On 2 and 4 gloo ranks, per layout (EP, ETP, TP with and without sequence parallelism, shadowed
experts, the counts and the padded exchange): one training forward and backward of ``MoELayer``
with torch.distributed's collectives wrapped and counted by (phase, call, ranks of the group), against
``placement.costs.moe_layer_collectives`` for the layout's sizes, mapped to the same groups.
"""
from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from moe_plugin.configs import MoEConfig
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer
from moe_plugin.placement.costs import moe_layer_collectives

S, B, H, F, E = 8, 2, 16, 16, 4
WRAPPED = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
           "reduce_scatter", "reduce_scatter_tensor", "broadcast", "barrier", "send", "recv")

# name -> (RankLayout.build sizes, sequence parallel, shadowed experts[, overlap_chunks[, aux_loss_scope[, exchange]]])
# (exchange "auto" on gloo: padded where the layout allows it, ``layers/padded_wire.py``; ``_counted`` checks which)
LAYOUTS2 = {
    "dp2-ep2": (dict(ep=2), False, []),
    "dp2-ep2-counts": (dict(ep=2), False, [], 1, "micro_batch", "counts"),
    "dp2-ep2-shadow": (dict(ep=2), False, [0]),
    "dp2-etp2": (dict(etp=2), False, []),
    "tp2": (dict(tp=2, etp=1), False, []),
    "tp2-ep2": (dict(tp=2, ep=2, etp=1), False, []),
    "tp2sp-ep2": (dict(tp=2, ep=2, etp=1), True, []),
    "dp2-ep2-overlap2": (dict(ep=2), False, [], 2),
    "dp2-ep2-overlap2-shadow": (dict(ep=2), False, [1], 2),    # shadowed: one exchange
    "tp2-ep2-sequence": (dict(tp=2, ep=2, etp=1), False, [], 1, "sequence"),
    "dp2-ep2-global": (dict(ep=2), False, [], 1, "global"),
    "dp2-ep2-token": (dict(ep=2), False, [], 1, "micro_batch", "token"),    # the collectives of counts
}
LAYOUTS4 = {
    "dp4-ep2": (dict(ep=2), False, []),                          # padded, the finite flags over TP x DP
    "dp4-ep2-counts": (dict(ep=2), False, [], 1, "micro_batch", "counts"),
    "ep4-padded": (dict(ep=4), False, [], 1, "micro_batch", "padded"),
    "ep4-token": (dict(ep=4), False, [], 1, "micro_batch", "token"),
    "tp2-ep2-etp2-dp2": (dict(tp=2, ep=2, etp=2), False, []),
    "tp2sp-ep4-dp2": (dict(tp=2, ep=4, etp=1), True, [1]),
    "tp2-ep2-dp2-overlap2": (dict(tp=2, ep=2, etp=1), False, [], 2),
    "tp2sp-ep2-dp2-sequence": (dict(tp=2, ep=2, etp=1), True, [], 1, "sequence"),
    "tp2-dp2-global": (dict(tp=2, etp=1), False, [], 1, "global"),
}


def _layer(world_size: int, groups, sizes: dict, sp: bool, chunks: int, scope: str, exchange: str) -> MoELayer:
    s = RankLayout.build(world_size, **sizes).sizes
    config = MoEConfig.from_dict({"num_experts": E, "router": "topk", "top_k": 2, "aux_loss_coeff": 0.1,
                                  "overlap_chunks": chunks, "aux_loss_scope": scope, "exchange": exchange,
                                  "parallel": {"tensor": s.tp, "expert": s.ep, "expert_tensor": s.etp,
                                               "sequence_parallel": sp}})
    return MoELayer(config, H, F, groups, seed=3).train()


def _counted(rank: int, world_size: int, layouts: dict) -> dict:
    """Per layout: (counted, charged) Counters of (phase, call, ranks of the group)."""
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    out = {}
    for name, (sizes, sp, shadow, *more) in layouts.items():
        groups = build_process_groups(RankLayout.build(world_size, **sizes))
        try:
            n, scope, exchange = (more + [1, "micro_batch", "auto"][len(more):])[:3]
            layer = _layer(world_size, groups, sizes, sp, n, scope, exchange)
            layer.set_shadow(shadow)
            g = groups.layout.sizes
            padded = g.ep > 1 and g.etp == 1 and not shadow and n == 1 and exchange not in ("counts", "token")
            assert layer.exchange == ("padded" if padded else exchange if exchange == "token" else "counts"), \
                (name, layer.exchange)
            s, p = groups.layout.sizes, layer.parallel
            ranks = {k: tuple(sorted(dist.get_process_group_ranks(g))) if g is not None else (rank,)
                     for k, g in (("ep", p.ep), ("etp", p.etp), ("tp", p.tp), ("tokens", p.tokens), ("dp", p.dp))}
            phase, calls = ["forward"], []

            def spy(real, call):
                def counted(*args, group=None, **kwargs):
                    members = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else "world"
                    calls.append((phase[0], call, members))
                    return real(*args, group=group, **kwargs)
                return counted

            x = torch.randn(S // (s.tp if sp else 1), B, H, generator=torch.Generator().manual_seed(rank))
            with mock.patch.multiple(dist, **{c: spy(getattr(dist, c), c) for c in WRAPPED}):
                y, _ = layer(x.requires_grad_(True))
                phase[0] = "backward"
                y.square().sum().backward()
            charged = [(c.phase, c.op, ranks[c.group])
                       for c in moe_layer_collectives(s.tp, s.dp, s.ep, s.etp, sp, shadowed=bool(shadow),
                                                      overlap_chunks=n, aux_loss_scope=scope,
                                                      exchange=layer.exchange)]
            out[name] = (Counter(calls), Counter(charged))
        finally:
            destroy_process_groups(groups)
    return out


def _check(results: list, layouts: dict) -> None:
    for rank, per_layout in enumerate(results):
        assert set(per_layout) == set(layouts)
        for name, (counted, charged) in per_layout.items():
            assert counted == charged, f"{name} rank {rank}: runs {dict(counted)}, the cost model charges {dict(charged)}"


@pytest.mark.slow
def test_charged_collectives_are_those_of_a_forward_and_backward_on_2_ranks(dist_run):
    _check(dist_run(_counted, 2, LAYOUTS2), LAYOUTS2)


@pytest.mark.slow
def test_charged_collectives_are_those_of_a_forward_and_backward_on_4_ranks(dist_run):
    _check(dist_run(_counted, 4, LAYOUTS4), LAYOUTS4)


def test_the_list_by_layout():
    """The kinds per layout, by hand: EP alone carries the finite flags in its counts exchange."""
    def kinds(*args, **kwargs):
        return Counter((c.phase, c.op, c.group, c.what) for c in moe_layer_collectives(*args, **kwargs))

    assert moe_layer_collectives(1, 1, 1, 1) == []
    assert kinds(1, 4, 4, 1) == Counter({("forward", "all_to_all_single", "ep", "counts"): 1,
                                         ("forward", "all_to_all_single", "ep", "rows"): 2,
                                         ("backward", "all_to_all_single", "ep", "rows"): 2})
    assert kinds(1, 4, 2, 1)[("forward", "all_to_all_single", "tokens", "finite flags")] == 1
    tp = kinds(2, 1, 1, 1)
    assert tp[("forward", "all_gather", "tp", "tokens")] == tp[("backward", "all_gather", "tp", "tokens")] == 1
    assert kinds(2, 1, 2, 1, sequence_parallel=True)[("forward", "all_gather", "tp", "tokens")] == 0
    assert kinds(1, 2, 2, 1, shadowed=True)[("backward", "all_reduce", "ep", "shadow gradients")] == 1
    overlapped = kinds(1, 4, 4, 1, overlap_chunks=3)
    assert overlapped[("forward", "all_to_all_single", "ep", "row chunk")] == 6 and not overlapped[
        ("forward", "all_to_all_single", "ep", "rows")]
    assert kinds(1, 4, 4, 1, shadowed=True, overlap_chunks=3)[("backward", "all_to_all_single", "ep", "rows")] == 2
    assert tp[("forward", "all_gather", "tp", "router logits")] == 1
    assert not kinds(1, 4, 4, 1)[("forward", "all_gather", "tp", "router logits")]
    assert kinds(2, 2, 1, 1, aux_loss_scope="sequence") == kinds(2, 2, 1, 1)
    assert kinds(1, 4, 4, 1, aux_loss_scope="global")[("forward", "all_reduce", "dp", "global load")] == 1
    assert not kinds(4, 1, 4, 1, aux_loss_scope="global")[("forward", "all_reduce", "dp", "global load")]
    assert moe_layer_collectives(1, 1, 1, 1, aux_loss_scope="global") == []
    padded = kinds(1, 4, 4, 1, exchange="padded")
    assert not padded[("forward", "all_to_all_single", "ep", "counts")]
    assert padded[("forward", "all_to_all_single", "ep", "rows")] == 2
    assert kinds(1, 4, 2, 1, exchange="padded")[("forward", "all_to_all_single", "tokens", "finite flags")] == 1
