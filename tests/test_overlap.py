"""``overlap_chunks`` > 1 (``moe_plugin/layers/overlap.py``) against the one-exchange layer.

On 2 and 4 gloo ranks (one spawn per world size), the same layer with ``overlap_chunks`` 1 and
n: outputs, input gradients and every parameter gradient bit-identical (each expert sees the
same rows in the same order; top-1 and top-2). The schedule (which all-to-all starts before
which compute) is checked on 2 ranks. The config refuses expert tensor parallelism and more
chunks than local experts.
"""
from __future__ import annotations

import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dist import case_results, run_distributed
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer
from test_layers_single import capacity_if_dropping

H, F, E = 16, 24, 8
ROUTERS = {
    "top1": dict(router="switch"),
    "top2": dict(router="topk", top_k=2, aux_loss_coeff=0.1, z_loss_coeff=1e-2),
    "gshard": dict(router="gshard", jitter_eps=0.1, aux_loss_coeff=0.1),
}
# name -> (RankLayout.build sizes, router, drop, chunks, extra "moe" keys)
CASES = {
    2: {
        "ep2/top1-capacity/c2": (dict(ep=2), "top1", True, 2, {}),
        "ep2/top2-dropless/c4": (dict(ep=2), "top2", False, 4, {}),
        "ep2/top2-capacity/c3-shared-swiglu": (dict(ep=2), "top2", True, 3,
                                               dict(activation="swiglu", shared_expert_ffn_hidden_size=8,
                                                    shared_expert_gate=True)),
        "tp2-ep2/gshard-dropless/c2": (dict(tp=2, ep=2, etp=1), "gshard", False, 2, {}),
    },
    4: {
        "ep4/top1-dropless/c2": (dict(ep=4), "top1", False, 2, {}),
        "ep4/top2-capacity/c2-shared": (dict(ep=4), "top2", True, 2, dict(shared_expert_ffn_hidden_size=8)),
        "ep2-dp2/top2-dropless/c4": (dict(ep=2), "top2", False, 4, {}),
    },
}


def _layer(sizes, router, drop, chunks, extra, groups) -> MoELayer:
    s = sizes
    block = {"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1, "drop_tokens": drop,
             "overlap_chunks": chunks, **ROUTERS[router], **extra,
             "parallel": {"tensor": s.tp, "expert": s.ep, "expert_tensor": s.etp, "order": s.order}}
    return MoELayer(MoEConfig.from_dict(capacity_if_dropping(block)), H, F, groups, seed=3, init_std=0.3).train()


def _run(layer: MoELayer, x_SBH: torch.Tensor) -> dict:
    x_SBH = x_SBH.clone().requires_grad_(True)
    torch.manual_seed(5)                       # the same router noise for both layers
    out_SBH, _ = layer(x_SBH)
    out_SBH.backward(torch.randn(out_SBH.shape, generator=torch.Generator().manual_seed(7)))
    return {"out": out_SBH.detach(), "grad_x": x_SBH.grad, "schedule": type(layer.dispatcher.schedule).__name__,
            **{f"grad_{n}": p.grad for n, p in layer.named_parameters()}}


def _child(rank: int, world_size: int, cases: dict) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    results = {}
    for name, (sizes, router, drop, chunks, extra) in cases.items():
        layout = RankLayout.build(world_size, **sizes)
        groups = build_process_groups(layout)
        try:
            x_SBH = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(11 + layout.coords(rank)["dp"]))
            results[name] = [_run(_layer(layout.sizes, router, drop, n, extra, groups), x_SBH) for n in (1, chunks)]
        except Exception:   # reported by the case's test
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        finally:
            destroy_process_groups(groups)
    return results


def _schedule_child(rank: int, world_size: int) -> list[str]:
    """The order of row all-to-alls (``a2a`` started async, ``A2A`` blocking), the shared expert
    and the expert GEMM chunks (``ffn``, ``ffn_bwd``) in a forward and backward of ep2 with 2
    chunks."""
    from moe_plugin.groups.builder import build_process_groups
    from moe_plugin.layers.experts import SharedExpert
    from moe_plugin.layers.ffn_autograd import ExpertFFN

    layout = RankLayout.build(world_size, ep=2)
    layer = _layer(layout.sizes, "top2", False, 2, dict(shared_expert_ffn_hidden_size=8), build_process_groups(layout))
    events, real_a2a, real_fwd, real_bwd = [], dist.all_to_all_single, ExpertFFN.forward, ExpertFFN.backward
    real_shared = SharedExpert.forward

    def a2a(out, x, *args, async_op=False, **kwargs):
        if x.dim() == 2 and x.shape[-1] == H:          # rows, not counts
            events.append("a2a" if async_op else "A2A")
        return real_a2a(out, x, *args, async_op=async_op, **kwargs)

    def logged(name, real):
        return staticmethod(lambda *args: events.append(name) or real(*args))

    with mock.patch.object(dist, "all_to_all_single", a2a), \
            mock.patch.object(ExpertFFN, "forward", logged("ffn", real_fwd)), \
            mock.patch.object(ExpertFFN, "backward", logged("ffn_bwd", real_bwd)), \
            mock.patch.object(SharedExpert, "forward", lambda self, x: events.append("shared") or real_shared(self, x)):
        x_SBH = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        out_SBH, _ = layer(x_SBH)
        events.append("backward")
        out_SBH.square().sum().backward()
    return events


@pytest.mark.slow
def test_later_chunks_move_while_earlier_ones_compute(tmp_path):
    """Forward: both chunks' rows leave before the shared expert and the first chunk's experts
    run, and each chunk's way back starts before the next chunk's experts; backward: both
    way-back gradients leave first, then each chunk's input gradient as soon as its experts'
    backward is done, while the other chunk's experts run theirs."""
    for events in run_distributed(_schedule_child, 2, tmp_path):
        assert " ".join(events) == "a2a a2a shared ffn a2a ffn a2a backward a2a a2a ffn_bwd a2a ffn_bwd a2a"


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request, tmp_path_factory):
    size = request.param
    return size, run_distributed(_child, size, tmp_path_factory.mktemp(f"overlap{size}"), CASES[size])


@pytest.mark.slow
def test_overlap_is_bit_identical_to_one_exchange(world):
    size, results = world
    for name in CASES[size]:
        for rank, result in enumerate(case_results(results, name)):
            one, chunked = result
            assert (one.pop("schedule"), chunked.pop("schedule")) == ("OneExchange", "Overlapped")
            assert one.keys() == chunked.keys()
            assert one["grad_experts.weight1"] is not None
            for key in one:
                assert torch.equal(one[key], chunked[key]), f"{name}, rank {rank}: {key} differs"


@pytest.mark.parametrize("block, match", [
    ({"parallel": {"expert": 2, "expert_tensor": 2}, "overlap_chunks": 2}, "overlap_chunks.*expert_tensor"),
    ({"parallel": {"expert": 4}, "overlap_chunks": 3}, "overlap_chunks.*at most the local experts \\(2"),
    ({"overlap_chunks": 0}, "overlap_chunks"),
])
def test_overlap_chunks_is_checked(block, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig.from_dict({"num_experts": 8, **block})
