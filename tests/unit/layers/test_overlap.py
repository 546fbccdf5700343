"""``overlap_chunks`` > 1 (``moe_plugin/layers/overlapped.py``): the schedule and the config.

The schedule (which all-to-all starts before which compute) is checked on 2 ranks. The config
refuses expert tensor parallelism and more chunks than local experts. The outputs, losses and
gradients against one exchange: the exchange twins of ``test_layers_dist.py`` (every counts case
there x every ``overlap_chunks`` its layout allows).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer

H, F, E = 16, 24, 8


def _schedule_child(rank: int, world_size: int) -> list[str]:
    """The order of row all-to-alls (``a2a`` started async, ``A2A`` blocking), the shared expert
    and the expert GEMM chunks (``ffn``, ``ffn_bwd``) in a forward and backward of ep2 with 2
    chunks."""
    from moe_plugin.groups.builder import build_process_groups
    from moe_plugin.layers.experts import SharedExpert
    from moe_plugin.layers.ffn_autograd import ExpertFFN

    layout = RankLayout.build(world_size, ep=2)
    config = MoEConfig.from_dict({"num_experts": E, "router": "topk", "top_k": 2, "drop_tokens": False,
                                  "overlap_chunks": 2, "shared_expert_ffn_hidden_size": 8, "parallel": {"expert": 2}})
    layer = MoELayer(config, H, F, build_process_groups(layout), seed=3, init_std=0.3).train()
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


@pytest.mark.parametrize("block, match", [
    ({"parallel": {"expert": 2, "expert_tensor": 2}, "overlap_chunks": 2}, "overlap_chunks.*expert_tensor"),
    ({"parallel": {"expert": 4}, "overlap_chunks": 3}, "overlap_chunks.*at most the local experts \\(2"),
    ({"overlap_chunks": 0}, "overlap_chunks"),
])
def test_overlap_chunks_is_checked(block, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig.from_dict({"num_experts": 8, **block})
