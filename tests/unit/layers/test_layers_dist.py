"""MoELayer under parallel layouts on gloo ranks, against the single-process loop oracle.

Each case builds the layer for one layout (``RankLayout.build`` -> ``build_process_groups``),
runs one training forward and backward on every rank with the same seed and injected router
noise, and then applies DeepSpeed's gradient convention in the child: dense gradients averaged
over ``dp``, expert gradients over ``edp``. The parent runs ``reference_moe`` once over all
DP replicas' tokens (one GShard group per replica: its TP ranks' shares together) with the loss
``mean_d L_d + aux`` and compares, for every rank: the output, the input gradient (``dp`` x
the oracle's, since a rank back-propagates its replica's loss ``L_d``), the balance and z loss
of the rank's replica, every parameter (the init) and every gradient -- router, shared expert,
and the expert shards mapped to their global slices -- fp32 at atol = rtol = 1e-5, bf16
inputs at 3e-2. Also: the summed statistics, the aux-loss-free bias update and the default
noise (the same on a replica's TP ranks, different across replicas).

The exchange twins (``TWINS``) are generated, not listed: every counts case (the default
``exchange``, ``overlap_chunks`` 1) x every other (exchange, overlap_chunks) that
``exchange_rules.exchange_variants`` -- the factory's rules -- allows its config: the padded
exchange (``layers/padded_wire.py``), the token exchange (``layers/token_wire.py``) and the counts
exchange overlapped in 2 .. local-experts chunks (``layers/overlapped.py``). Each twin is checked
against its counts case, not the oracle (``test_exchange_twin``): padded and overlapped
bit-identical (outputs, losses, every gradient), token equal to rounding. The full cross product, no subset rule: on 2026-11-25 it
cost about 10 CPU seconds more in the spawns, and the file ran shorter than with the hand-listed
twins (a twin is checked against its counts case, not the oracle).

Starting ranks costs seconds on two cores, so one 4-rank and one 2-rank run (module-scoped
fixtures) serve all cases and twins, a layout's twins in the build of its groups; each is its
own test id. A case that raises in the children is reported by its test; a hang ends the run
at the harness timeout.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from moe_plugin.configs import MoEConfig
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer, RouterNoise, reference_moe
from moe_plugin.placement.rules import exchange_variants
from moe_plugin.layers.experts import GATED
from tests.unit.layers.test_layers_single import capacity_if_dropping

S, B, H, F, E = 8, 2, 16, 16, 8        # per DP replica: T = S * B = 16 tokens
TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
NAN_MESSAGE = r"MoE router logits are not finite on rank\(s\) \[{}\]: the MoE layer input .* contains NaN or inf"

ROUTERS = {
    "gshard": dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=0.1),  # random routing
    "switch": dict(router="switch", z_loss_coeff=1e-2, aux_loss_coeff=0.1),
    "topk3": dict(router="topk", top_k=3, aux_loss_coeff=0.1, z_loss_coeff=1e-3),
    # not swept over layouts: the edge cases below place them
    "sigmoid2": dict(router="topk", top_k=2, score_function="sigmoid", gate_scale=2.5, aux_loss_coeff=0.1),
    "sigmoid4-raw": dict(router="topk", top_k=4, score_function="sigmoid", normalize_gates=False, gate_scale=0.5,
                         aux_loss_coeff=0.1, z_loss_coeff=1e-3),
    "probability1": dict(router="switch", drop_policy="probability", capacity_factor=0.5, aux_loss_coeff=0.1),
    "probability2": dict(router="topk", top_k=2, drop_policy="probability", capacity_factor=0.5, z_loss_coeff=1e-3),
    # group-limited, router_groups explicit: the same model on 1, 2 and 4 ranks
    "grouped3": dict(router="topk", top_k=3, score_function="sigmoid", router_groups=4, group_topk=2,
                     aux_loss_coeff=0.1),
    "grouped2": dict(router="topk", top_k=2, router_groups=2, group_topk=1, aux_loss_coeff=0.1, z_loss_coeff=1e-3),
    "grouped2-of-4": dict(router="topk", top_k=2, router_groups=4, group_topk=1, aux_loss_coeff=0.1),
}
SWEPT = ("gshard", "switch", "topk3")

SWIGLU_SHARED = dict(activation="swiglu", shared_expert_ffn_hidden_size=8, shared_expert_gate=True)
# GPT-OSS's experts and router; a clamp low enough to cut (the ``biases`` edit makes every bias non-zero)
GPT_OSS = dict(activation="clamped_swiglu", swiglu_limit=0.6, expert_linear_bias=True, router_logit_bias=True)

# name -> (RankLayout.build sizes, sequence parallel). Comments: dp, edp, expert grad factor edp/dp.
LAYOUTS4 = {
    "ep4": (dict(ep=4), False),                                  # dp 4, edp 1: 1/4
    "ep2-dp4": (dict(ep=2), False),                              # dp 4, edp 2: 1/2
    "ep2-etp2-dp4": (dict(ep=2, etp=2), False),                  # dp 4, edp 1: 1/4
    "tp2-ep2-dp2": (dict(tp=2, ep=2, etp=1), False),             # ep folded over TP: dp 2, edp 2: 1
    "tp2-ep2-etp2-dp2": (dict(tp=2, ep=2, etp=2), False),        # dp 2, edp 1: 1/2
    "tp2sp-ep2-etp2-dp2": (dict(tp=2, ep=2, etp=2), True),       # dp 2, edp 1: 1/2
    "tp2sp-ep4-dp2": (dict(tp=2, ep=4, etp=1), True),            # EP over TP and DP: dp 2, edp 1: 1/2
    "pp2-ep2-dp2": (dict(pp=2, ep=2), False),                    # two stages, each dp 2, edp 1: 1/2
    "ep2-dp4-order-dp-ep": (dict(ep=2, order="tp-cp-dp-ep-pp"), False),  # EP peers 2 ranks apart
}
LAYOUTS2 = {
    "dp2-ep2": (dict(ep=2), False),                              # dp 2, edp 1: 1/2
    "etp2-dp2": (dict(etp=2), False),                            # dp 2, edp 1: 1/2
    "tp2": (dict(tp=2, etp=1), False),                           # dp 1, edp 2: 2
    "tp2sp": (dict(tp=2, etp=1), True),                          # dp 1, edp 2: 2
    "tp2sp-etp2": (dict(tp=2), True),                            # dp 1, edp 1: 1
    "tp2-ep2": (dict(tp=2, ep=2, etp=1), False),                 # EP folded over TP: 1
    "tp2sp-ep2": (dict(tp=2, ep=2, etp=1), True),
}


def _case(layouts, layout, router="gshard", drop=True, *, S=S, B=B, edit=None, dtype="float32",
          bias_update=False, nan_rank=None, nan_value=float("nan"), placement=None, earlier=False, **moe):
    sizes, sp = layouts[layout]
    return dict(layout=layout, sizes=sizes, sp=sp, router=router, drop=drop, S=S, B=B, edit=edit, dtype=dtype,
                bias_update=bias_update, nan_rank=nan_rank, nan_value=nan_value, placement=placement,
                earlier=earlier, moe=moe)


# A placement that moves every expert to another EP rank: slot of expert e.
SHUFFLED = [5, 2, 7, 0, 3, 6, 1, 4]


def _cases(layouts, full_sweep, edge) -> dict[str, dict]:
    cases = {}
    for layout in layouts:
        routers = SWEPT if layout in full_sweep else ["gshard"]
        for router in routers:
            for drop in (True, False):
                extra = SWIGLU_SHARED if not drop else {}
                cases[f"{layout}/{router}-{'drop' if drop else 'dropless'}"] = _case(layouts, layout, router, drop, **extra)
    for name, (layout, kwargs) in edge.items():
        cases[f"{layout}/{name}"] = _case(layouts, layout, **kwargs)
    return cases


# Edge cases: "hot0" sends every token's first choice to expert 0 (router weight and input);
# "last" biases every choice to expert E-1, so ranks not hosting it send all rows away and
# receive none; "cold3" leaves expert 3 without tokens.
CASES4 = _cases(LAYOUTS4, full_sweep=("ep4", "tp2sp-ep2-etp2-dp2", "tp2-ep2-dp2"), edge={
    "all-to-expert-0": ("ep4", dict(router="gshard", edit="hot0", second_expert_policy="all")),
    "all-to-expert-0-dropless": ("tp2-ep2-etp2-dp2", dict(router="switch", drop=False, edit="hot0")),
    "expert-without-tokens": ("ep2-etp2-dp4", dict(router="topk3", edit="cold3")),
    "one-token-remote": ("ep4", dict(router="switch", S=1, B=1, edit="last")),
    "one-token-remote-tp": ("tp2-ep2-dp2", dict(router="gshard", S=2, B=1, edit="last")),
    "one-token-sp-etp": ("tp2sp-ep2-etp2-dp2", dict(router="topk3", S=2, B=1, min_capacity=0)),
    "bf16": ("tp2sp-ep2-etp2-dp2", dict(router="gshard", dtype="bfloat16", **SWIGLU_SHARED)),
    "bf16-ep4": ("ep4", dict(router="topk3", dtype="bfloat16")),
    "bias-update": ("tp2-ep2-dp2", dict(router="topk3", drop=False, bias_update=True, bias_update_rate=0.1)),
    "placement": ("ep4", dict(router="gshard", placement=SHUFFLED)),
    "placement-dropless-etp": ("ep2-etp2-dp4", dict(router="topk3", drop=False, placement=SHUFFLED)),
    "placement-hot": ("tp2sp-ep4-dp2", dict(router="switch", edit="hot0", placement=SHUFFLED)),
    "nan-on-one-rank": ("tp2sp-ep2-etp2-dp2", dict(nan_rank=3)),
    "inf-on-one-rank": ("ep4", dict(nan_rank=0, nan_value=-float("inf"))),
    "sigmoid2-drop": ("ep4", dict(router="sigmoid2")),
    "sigmoid2-dropless": ("tp2-ep2-dp2", dict(router="sigmoid2", drop=False)),
    "sigmoid4-raw-drop": ("tp2sp-ep2-etp2-dp2", dict(router="sigmoid4-raw")),
    "sigmoid4-raw-dropless": ("ep4", dict(router="sigmoid4-raw", drop=False, **SWIGLU_SHARED)),
    "probability1-drop": ("tp2sp-ep4-dp2", dict(router="probability1")),
    "probability2-drop": ("ep4", dict(router="probability2", placement=SHUFFLED)),
    # aux_loss_scope: against one rank routing the whole global batch (``_check_scope_case``)
    "scope-global": ("ep4", dict(router="switch", drop=False, aux_loss_scope="global")),
    "scope-global-sp": ("tp2sp-ep4-dp2", dict(router="topk3", drop=False, aux_loss_scope="global")),
    "scope-global-accumulated": ("ep2-dp4", dict(router="sigmoid2", drop=False, aux_loss_scope="global",
                                                 earlier=True)),
    "scope-sequence-sp": ("tp2sp-ep2-etp2-dp2", dict(router="topk3", drop=False, aux_loss_scope="sequence")),
    "scope-sequence-tp": ("tp2-ep2-dp2", dict(router="sigmoid2", drop=False, aux_loss_scope="sequence",
                                              earlier=True)),
    "grouped3-drop": ("ep4", dict(router="grouped3", placement=SHUFFLED)),    # groups by expert id, not slot
    "grouped2-dropless": ("tp2-ep2-dp2", dict(router="grouped2", drop=False)),
    "nan-on-one-rank-ep2": ("ep2-dp4", dict(nan_rank=2)),     # the finite flags over TP x DP
    "grouped2-of-4-drop": ("ep4", dict(router="grouped2-of-4")),       # groups = the EP ranks: one rank a token
    "gpt-oss-etp": ("tp2sp-ep2-etp2-dp2", dict(router="topk3", drop=False, edit="biases", **GPT_OSS)),
    "gpt-oss-placement": ("ep4", dict(router="topk3", edit="biases", placement=SHUFFLED, **GPT_OSS)),
})
CASES2 = _cases(LAYOUTS2, full_sweep=("dp2-ep2", "tp2-ep2"), edge={
    "all-to-expert-0": ("tp2-ep2", dict(router="gshard", edit="hot0")),
    "expert-without-tokens": ("dp2-ep2", dict(router="gshard", drop=False, edit="cold3", second_expert_policy="all")),
    "one-token-remote": ("dp2-ep2", dict(router="switch", S=1, B=1, edit="last")),
    "one-token-remote-tp": ("tp2-ep2", dict(router="topk3", S=2, B=1, edit="last")),
    "bf16": ("tp2-ep2", dict(router="switch", dtype="bfloat16", **SWIGLU_SHARED)),
    "bias-update": ("dp2-ep2", dict(router="switch", bias_update=True, bias_update_rate=0.1)),
    "placement": ("tp2-ep2", dict(router="gshard", placement=SHUFFLED)),
    "nan-on-one-rank": ("tp2-ep2", dict(nan_rank=1)),
    "sigmoid2-drop": ("tp2-ep2", dict(router="sigmoid2")),
    "sigmoid2-dropless": ("dp2-ep2", dict(router="sigmoid2", drop=False)),
    "sigmoid4-raw-drop": ("dp2-ep2", dict(router="sigmoid4-raw")),
    "sigmoid4-raw-dropless": ("tp2sp", dict(router="sigmoid4-raw", drop=False)),
    "probability1-drop": ("dp2-ep2", dict(router="probability1")),
    "probability2-drop": ("tp2sp-ep2", dict(router="probability2")),
    "scope-global": ("tp2sp-ep2", dict(router="switch", drop=False, aux_loss_scope="global", earlier=True)),
    "scope-sequence": ("dp2-ep2", dict(router="switch", drop=False, aux_loss_scope="sequence")),
    # 3 positions x 2 sequences split over 2 TP ranks: rank 1's share starts inside position 1
    "scope-sequence-tp-odd": ("tp2", dict(router="sigmoid2", drop=False, S=3, aux_loss_scope="sequence")),
    "grouped3-drop": ("dp2-ep2", dict(router="grouped3")),
    "grouped2-dropless": ("tp2-ep2", dict(router="grouped2", drop=False, placement=SHUFFLED)),
    # no route dropped (S 4: the oracle check skips its "drops something")
    "no-drop": ("dp2-ep2", dict(router="topk3", S=4, capacity_factor=4.0)),
    # bf16 counts of capacity 300: two base-256 digits in the padded exchange's header
    "bf16-two-digits": ("dp2-ep2", dict(router="topk3", S=4, dtype="bfloat16", min_capacity=300)),
    "gpt-oss-etp": ("etp2-dp2", dict(router="topk3", drop=False, edit="biases", **GPT_OSS)),
    "gpt-oss-tp": ("tp2-ep2", dict(router="topk3", drop=False, edit="biases", **GPT_OSS)),
})
TWIN_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


# -- shared by parent and children -------------------------------------------------------------
def _config(case: dict, world_size: int | None = None) -> MoEConfig:
    block = {"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1, **ROUTERS[case["router"]],
             "drop_tokens": case["drop"], **case["moe"]}
    block = capacity_if_dropping(block)
    if world_size is not None:   # the parallel layer's config describes its layout
        s = RankLayout.build(world_size, **case["sizes"]).sizes
        block["parallel"] = {"tensor": s.tp, "pipeline": s.pp, "expert": s.ep, "expert_tensor": s.etp,
                             "order": s.order, "sequence_parallel": case["sp"]}
    else:   # one process exchanges nothing
        block.pop("exchange", None)
        block.pop("overlap_chunks", None)
    return MoEConfig.from_dict(block)


def _twins(cases: dict, world_size: int) -> dict[str, tuple[str, dict]]:
    """Twin name -> (its counts case, the twin case): every counts case (the default ``exchange``,
    ``overlap_chunks`` 1) x every other (exchange, overlap_chunks) that ``exchange_variants`` (the
    factory's rules) allows its config. Named ``<case>~padded``, ``<case>~token``, ``<case>~c<n>``."""
    twins = {}
    for name, case in cases.items():
        if case["moe"].get("exchange", "counts") != "counts" or case["moe"].get("overlap_chunks", 1) != 1:
            continue
        config = _config(case, world_size)
        p, pl = config.parallel, config.placement
        variants = exchange_variants(expert=p.expert, expert_tensor=p.etp, num_experts=config.num_experts,
                                     drop_tokens=config.drop_tokens, replica_budget=pl.replica_budget,
                                     policy=pl.policy, trace_file=pl.trace_file)
        assert variants[0] == ("counts", 1), variants
        for mode, chunks in variants[1:]:
            twin = dict(case, moe={**case["moe"], "exchange": mode, "overlap_chunks": chunks})
            twins[f"{name}~{mode if chunks == 1 else f'c{chunks}'}"] = name, twin
    return twins


TWINS = {4: _twins(CASES4, 4), 2: _twins(CASES2, 2)}


def _layer(case: dict, world_size: int | None = None, groups=None) -> MoELayer:
    layer = MoELayer(_config(case, world_size), H, F, groups, seed=3, init_std=0.3, placement=case["placement"])
    with torch.no_grad():
        if case["edit"] == "hot0":
            layer.router.weight[0, 0] = 10.0
        elif case["edit"] == "last":
            layer.router.expert_bias[E - 1] = 1e3
        elif case["edit"] == "cold3":
            layer.router.expert_bias[3] = -1e3
        elif case["edit"] == "biases":   # full values by expert id; each rank takes its slots' share
            gen = torch.Generator().manual_seed(5)
            layer.router.bias.copy_(torch.randn(E, generator=gen) * 0.3)
            full = {"experts.bias1": torch.randn(E, 2 * F, generator=gen) * 0.3,
                    "experts.bias2": torch.randn(E, H, generator=gen) * 0.3}
            for name, value in full.items():
                if groups is not None:
                    layout = groups.layout
                    value = _expert_slice(name, value, layout.coords(dist.get_rank()), layout.sizes,
                                          layer.config.activation, case["placement"])
                layer.get_parameter(name).copy_(value)
    return layer.train()


def _inputs(case: dict, dp: int):
    """All DP replicas' tokens [dp, S, B, H] (in the case's dtype), upstream gradients, noise."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(dp, case["S"], case["B"], H, generator=gen)
    if case["edit"] == "hot0":
        x[..., 0] = 3.0
    x = x.to(getattr(torch, case["dtype"]))
    grad = torch.randn(dp, case["S"], case["B"], H, generator=gen)
    config = _config(case)
    T = dp * case["S"] * case["B"]
    jitter = torch.rand(T, H, generator=gen) * 0.2 + 0.9 if config.jitter_eps > 0 else None
    uniform = (torch.rand(T, generator=gen)
               if config.router == "gshard" and config.second_expert_policy == "random" else None)
    return x, grad, jitter, uniform


# -- children --------------------------------------------------------------------------------------
def _schedule(layer: MoELayer) -> tuple[str, int]:
    """The schedule the layer's dispatcher runs and its chunks (``OneExchange``: 1)."""
    schedule = layer.dispatcher.schedule
    return type(schedule).__name__, getattr(schedule, "chunks", 1)


def _run_case(rank: int, groups, case: dict) -> dict:
    layout = groups.layout
    tp, dp = layout.sizes.tp, layout.sizes.dp
    c = layout.coords(rank)
    layer = _layer(case, layout.world_size, groups)
    x_all, grad_all, jitter, uniform = _inputs(case, dp)
    x, grad = x_all[c["dp"]], grad_all[c["dp"]]
    if case["sp"]:
        x, grad = x.chunk(tp)[c["tp"]], grad.chunk(tp)[c["tp"]]
    T = case["S"] * case["B"]                         # the replica's tokens: one GShard group
    rows = slice(c["dp"] * T, (c["dp"] + 1) * T)
    noise = RouterNoise(jitter_TH=None if jitter is None else jitter[rows],
                        uniform_T=None if uniform is None else uniform[rows])
    x = x.clone()
    if case["nan_rank"] is not None:
        if rank == case["nan_rank"]:
            x[-1, -1, 1] = case["nan_value"]           # in this rank's share also without SP
        with pytest.raises(ValueError, match=NAN_MESSAGE.format(case["nan_rank"])) as failure:
            layer(x, noise=noise)
        x = torch.where(torch.isfinite(x), x, 0.0)     # the ranks are still in step afterwards
        out, _ = layer(x, noise=noise)
        return {"message": str(failure.value), "after": out.detach(), "exchange": layer.exchange,
                "schedule": _schedule(layer)}

    if case["earlier"]:       # an earlier micro-batch of the same optimizer step (gradient accumulation)
        earlier, _ = layer(-x, noise=noise)
        (earlier.float() * grad).sum().backward()
    sent = []            # the token exchange's state: the rows it really sends
    if layer.exchange == "token":
        with pytest.raises(ValueError, match="shadow experts: not with moe.exchange 'token'"):
            layer.set_shadow([0])
        prepare = layer.dispatcher.prepare
        layer.dispatcher.prepare = lambda *args: sent.append(prepare(*args)) or sent[-1]
    x.requires_grad_(True)
    out, _ = layer(x, noise=noise)
    (out.float() * grad).sum().backward()
    grads = {}
    for name, p in layer.named_parameters():          # DeepSpeed's convention
        g = p.grad.detach().clone()
        reduce_group = groups.edp if getattr(p, "allreduce", True) is False else groups.dp
        if reduce_group is not None:
            dist.all_reduce(g, group=reduce_group)
            g /= dist.get_world_size(reduce_group)
        grads[name] = g
    stats = layer.last_stats
    result = {"stats_kept": stats.kept_per_expert, "out": out.detach(), "x_grad": x.grad, "grads": grads,
              "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
              "balance": stats.balance_loss, "z": stats.z_loss, "global": layer.global_stats(),
              "noise": layer.router.draw_noise(4, H).uniform_T, "local_experts": layer.local_experts(),
              "placement": layer.state_dict()["experts.placement"], "exchange": layer.exchange,
              "schedule": _schedule(layer)}
    if layout.sizes.ep > 1 and layer.exchange != "padded":   # every EP peer's kept routes per expert, agreed
        result["traffic"] = stats.traffic_PE                # over the EP group (the padded exchange has none)
    elif layout.sizes.ep > 1:
        assert stats.traffic_PE is None
    if sent:
        from moe_plugin_tools.bench.traffic import token_rank_rows_sent

        state, P, me = sent[-1], layout.sizes.ep, c["ep"]
        result["rows_sent"] = sum(state.row_send) - state.row_send[me]     # to the other EP ranks
        result["token_rank_rows"] = token_rank_rows_sent(state.plan.token_R, state.plan.slot_R(), E // P, P, me)
        result["row_width"] = state.send_UX.shape[1]
    if case["bias_update"]:
        layer.update_expert_bias()
        result["bias"] = layer.router.expert_bias.clone()
    return result


def _cases_child(rank: int, world_size: int, cases: dict) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    results = {}
    by_layout: dict[str, list[str]] = {}
    for name, case in cases.items():
        by_layout.setdefault(case["layout"], []).append(name)
    for names in by_layout.values():
        groups = build_process_groups(RankLayout.build(world_size, **cases[names[0]]["sizes"]))
        try:
            for name in names:
                try:
                    results[name] = _run_case(rank, groups, cases[name])
                except (Exception, pytest.fail.Exception):   # reported by the case's test; the next goes on
                    results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        finally:
            destroy_process_groups(groups)
    return results


# -- the parent's checks ---------------------------------------------------------------------------
def _expert_slice(name: str, full: torch.Tensor, c: dict, sizes, activation: str, placement=None) -> torch.Tensor:
    """This rank's shard of a full [E, ...] expert tensor (expert order): the experts in its
    slots, its F columns/rows."""
    L, f = E // sizes.ep, F // sizes.etp
    if placement is not None:
        full = full[torch.argsort(torch.tensor(placement))]    # slot order
    w = full[c["ep"] * L:(c["ep"] + 1) * L]
    cols = slice(c["etp"] * f, (c["etp"] + 1) * f)
    if name == "experts.weight2":
        return w[:, cols]
    if name == "experts.bias2":   # whole on every ETP rank
        return w
    if activation in GATED:
        return torch.cat([w[..., :F][..., cols], w[..., F:][..., cols]], dim=-1)
    return w[..., cols]


def _check_case(case: dict, world_size: int, results: list) -> None:
    for rank, result in enumerate(results):
        if isinstance(result, str):
            pytest.fail(result, pytrace=False)
    layout = RankLayout.build(world_size, **case["sizes"])
    sizes = layout.sizes
    tp, dp = sizes.tp, sizes.dp
    if case["moe"].get("aux_loss_scope", "micro_batch") != "micro_batch":
        return _check_scope_case(case, layout, results)
    if case["nan_rank"] is not None:
        for result in results:
            assert f"rank(s) [{case['nan_rank']}]" in result["message"]
            assert result["exchange"] == case["moe"].get("exchange", result["exchange"])
            assert torch.isfinite(result["after"]).all()
        return

    layer = _layer({**case, "placement": None})      # the oracle's weights in expert order
    config = layer.config
    x_all, grad_all, jitter, uniform = _inputs(case, dp)
    T = case["S"] * case["B"]
    params = {name: p.detach().clone().requires_grad_(True) for name, p in layer.named_parameters()}
    params["router.expert_bias"] = layer.router.expert_bias.clone()
    x_ref = x_all.reshape(-1, H).float().requires_grad_(True)
    ref = reference_moe(x_ref, params, config, training=True, jitter_TH=jitter, uniform_T=uniform,
                        group_sizes=[T] * dp)
    loss = (ref.out.float() * grad_all.reshape(-1, H)).sum() / dp + ref.weighted_aux_loss(config)
    loss.backward()

    # The case routes as its name says.
    routed, kept = ref.routed_per_expert, ref.kept_per_expert
    if case["edit"] == "hot0":
        assert routed[0] == dp * T
    elif case["edit"] == "last":
        assert routed[E - 1] == dp * T
    elif case["edit"] == "cold3":
        assert routed[3] == 0
    elif case["drop"] and case["S"] == S:
        assert sum(kept) < sum(routed), "the case should exercise capacity dropping"
    if case["drop"] and config.drop_policy == "probability":   # it keeps other routes than position would
        position = config.model_copy(update={"drop_policy": "position"})
        other = reference_moe(x_ref.detach(), params, position, training=True, group_sizes=[T] * dp)
        assert not torch.allclose(other.out, ref.out), "the case should tell the drop policies apart"

    tol = TOL if case["dtype"] == "float32" else BF16_TOL
    for rank, result in enumerate(results):
        c = layout.coords(rank)
        group, n = c["dp"], T // tp                   # its replica's GShard group; its SP share
        rows = slice((group * tp + c["tp"]) * n, (group * tp + c["tp"] + 1) * n) if case["sp"] \
            else slice(group * T, (group + 1) * T)

        def close(actual, expected, what, tol=tol):
            torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"rank {rank} {what}: {m}")

        close(result["out"].reshape(-1, H), ref.out[rows].detach(), "output")
        close(result["x_grad"].reshape(-1, H), x_ref.grad[rows] * dp, "input gradient")
        close(result["balance"], ref.group_balance_losses[group].detach(), "balance loss", TOL)
        close(result["z"], ref.group_z_losses[group].detach(), "z loss", TOL)
        for name, grad in result["grads"].items():
            full_param, full_grad = params[name].detach(), params[name].grad
            if name.startswith("experts."):
                full_param = _expert_slice(name, full_param, c, sizes, config.activation, case["placement"])
                full_grad = _expert_slice(name, full_grad, c, sizes, config.activation, case["placement"])
                if name == "experts.bias2" and c["etp"] != 0:   # added on ETP rank 0 only
                    full_grad = torch.zeros_like(full_grad)
            assert torch.equal(result["params"][name], full_param), f"rank {rank} {name}: init is not the slice"
            close(grad, full_grad, f"{name} gradient")
        placement = torch.arange(E) if case["placement"] is None else torch.tensor(case["placement"])
        assert torch.equal(result["placement"], placement)
        L = E // sizes.ep
        assert result["local_experts"] == torch.argsort(placement)[c["ep"] * L:(c["ep"] + 1) * L].tolist()
        if "traffic" in result:   # row p: EP peer p's kept routes per expert
            expected = torch.stack([results[r]["stats_kept"] for r in layout.group_of("ep", rank)])
            assert torch.equal(result["traffic"], expected), (rank, result["traffic"], expected)
        stats = result["global"]
        assert stats.kept_per_expert.tolist() == ref.kept_per_expert, rank
        assert stats.routed_per_expert.tolist() == ref.routed_per_expert, rank
        close(stats.balance_loss, ref.balance_loss.detach(), "mean balance loss", TOL)
        if "bias" in result:   # the same on every rank: one step from the load of all token groups
            load = torch.tensor(ref.routed_per_expert, dtype=torch.float32)
            expected = config.bias_update_rate * torch.sign(load.mean() - load) + params["router.expert_bias"]
            assert torch.equal(result["bias"], expected), (rank, result["bias"], expected)
    if uniform is not None:   # the default generator: the same numbers within a replica, others across
        stage = [r for r in range(world_size) if layout.coords(r)["pp"] == 0]
        draws = {layout.coords(r)["dp"]: tuple(results[r]["noise"].tolist()) for r in stage}
        assert all(tuple(results[r]["noise"].tolist()) == draws[layout.coords(r)["dp"]] for r in stage)
        assert len(set(draws.values())) == dp


def _check_scope_case(case: dict, layout, results: list) -> None:
    """aux_loss_scope sequence / global: every rank's output, input gradient and (averaged)
    gradients, and the balance loss averaged over the ranks, equal one process that routes the
    whole global batch in one micro-batch (the DP replicas' sequences side by side; before it, with
    ``earlier``, the earlier micro-batch's whole batch). Dropless, so capacity does not depend on
    the layout either."""
    sizes = layout.sizes
    tp, dp = sizes.tp, sizes.dp
    x_all, grad_all, _, _ = _inputs(case, dp)
    S_, B_ = case["S"], case["B"]
    whole = lambda t: t.transpose(0, 1).reshape(S_, dp * B_, H)      # [dp, S, B, H] -> [S, dp * B, H]
    single = _layer({**case, "placement": None})
    x1, grad1 = whole(x_all), whole(grad_all)
    if case["earlier"]:
        earlier, _ = single(-x1)
        (earlier * grad1).sum().div(dp).backward()
    x1.requires_grad_(True)
    out1, _ = single(x1)
    (out1 * grad1).sum().div(dp).backward()
    per_rank = lambda t, c: t.view(S_, dp, B_, H)[:, c["dp"]].chunk(tp if case["sp"] else 1)[c["tp"] if case["sp"] else 0]
    params = {name: p.detach() for name, p in single.named_parameters()}
    micro = reference_moe(x_all.reshape(-1, H), params, single.config, training=True,   # each rank's own loss
                          group_sizes=[S_ * B_] * dp)
    assert not torch.allclose(micro.balance_loss, single.last_stats.balance_loss, **TOL), "the scopes should differ"
    for rank, result in enumerate(results):
        c = layout.coords(rank)

        def close(actual, expected, what):
            torch.testing.assert_close(actual.float(), expected.float(), **TOL, msg=lambda m: f"rank {rank} {what}: {m}")

        close(result["out"], per_rank(out1.detach(), c), "output")
        close(result["x_grad"], per_rank(x1.grad, c) * dp, "input gradient")
        close(result["global"].balance_loss, single.last_stats.balance_loss, "balance loss (mean over ranks)")
        for name, grad in result["grads"].items():
            full = dict(single.named_parameters())[name].grad
            if name.startswith("experts."):
                full = _expert_slice(name, full, c, sizes, single.config.activation)
            close(grad, full, f"{name} gradient")


def _with_twins(cases: dict, world_size: int) -> dict:
    """The cases and their twins: the child runs each layout's twins with its cases (one build of its groups)."""
    return {**cases, **{name: twin for name, (_, twin) in TWINS[world_size].items()}}


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return run_distributed(_cases_child, 4, tmp_path_factory.mktemp("layers4"), _with_twins(CASES4, 4), timeout=240)


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return run_distributed(_cases_child, 2, tmp_path_factory.mktemp("layers2"), _with_twins(CASES2, 2), timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES4))
def test_layer_on_4_ranks(name, results4):
    _check_case(CASES4[name], 4, [r[name] for r in results4])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES2))
def test_layer_on_2_ranks(name, results2):
    _check_case(CASES2[name], 2, [r[name] for r in results2])


@pytest.mark.slow
@pytest.mark.parametrize("size, twin", [(n, name) for n, twins in TWINS.items() for name in twins])
def test_exchange_twin(size, twin, request):
    """A twin against its counts case, on every rank. padded (the same rows reach the same experts
    in the same order, and the way back is the same) and the overlapped schedule (each expert sees
    the same rows in the same order): outputs, losses, every gradient, the statistics and the bias
    update bit-identical. token (each token sent once per destination rank): the same outputs and
    traffic, losses and gradients equal to rounding (``TWIN_TOL``: the experts sum their rows in
    token order), and the rows on the wire are the distinct (token, rank) pairs the bench's
    ``token_rank_a2a_step_bytes`` counts. A NaN case: the same error, the same output after it."""
    counts, case = TWINS[size][twin]
    mode, chunks = case["moe"]["exchange"], case["moe"]["overlap_chunks"]
    for rank, r in enumerate(request.getfixturevalue(f"results{size}")):
        a, b = r[twin], r[counts]
        assert not isinstance(a, str) and not isinstance(b, str), a if isinstance(a, str) else b
        assert (a["exchange"], a["schedule"]) == (mode, ("Overlapped", chunks) if chunks > 1 else ("OneExchange", 1))
        assert (b["exchange"], b["schedule"]) == ("counts", ("OneExchange", 1)), rank
        if "message" in b:
            assert a["message"] == b["message"], rank
            assert torch.equal(a["after"], b["after"]), f"rank {rank}: the output after the error differs"
            continue

        def same(x, y, what):
            if mode == "token" and what not in ("out", "traffic", "kept", "routed", "bias"):
                torch.testing.assert_close(x, y, **TWIN_TOL[a["out"].dtype], msg=lambda m: f"rank {rank}: {what}: {m}")
            else:
                assert torch.equal(x, y), f"rank {rank}: {what} differs"

        for key in ("out", "x_grad", "balance", "z", "bias"):
            assert (key in a) == (key in b), (rank, key)
            if key in a:
                same(a[key], b[key], key)
        assert a["grads"].keys() == b["grads"].keys()
        for name in a["grads"]:
            same(a["grads"][name], b["grads"][name], f"{name} gradient")
        same(a["global"].kept_per_expert, b["global"].kept_per_expert, "kept")
        same(a["global"].routed_per_expert, b["global"].routed_per_expert, "routed")
        same(a["global"].balance_loss, b["global"].balance_loss, "mean balance loss")
        assert ("traffic" in a) == (mode != "padded"), rank      # the padded exchange has no traffic
        if mode != "padded":
            same(a["traffic"], b["traffic"], "traffic")
        if mode == "token":
            assert a["rows_sent"] == a["token_rank_rows"], rank
            assert a["row_width"] == H + 1, rank        # 2 or 4 local experts: one mask column


@pytest.mark.parametrize("dtype, columns", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 2)])
def test_token_exchange_masks_over_columns(dtype, columns):
    """One process, 16 slots: the masks need 2 columns in bf16 (8 bits each) and fp16 (11); the
    fan-out and the way back give the local dispatcher's outputs and gradients."""
    from moe_plugin.layers import Dispatcher, LayerParallelism, TokenWire

    config = MoEConfig.from_dict({"num_experts": 16, "router": "topk", "top_k": 6, "capacity_factor": 1.0,
                                  "min_capacity": 1, "aux_loss_coeff": 0.1})
    runs, states = [], []
    for token in (False, True):
        layer = MoELayer(config, H, F, seed=3, init_std=0.3).train()
        if token:
            layer.dispatcher = Dispatcher(TokenWire(LayerParallelism(), 16))
            prepare = layer.dispatcher.prepare
            layer.dispatcher.prepare = lambda *args: states.append(prepare(*args)) or states[-1]
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
        out, _ = layer(x)
        (out.float() * torch.arange(H)).sum().backward()
        runs.append([out, x.grad] + [p.grad for p in layer.parameters()])
    assert states[0].send_UX.shape[1] == H + columns and states[0].plan.route_R.numel() > states[0].row_send[0]
    assert layer.last_stats.dropped_fraction > 0
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, **TWIN_TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16])


def _failing_child(rank: int, world_size: int) -> None:
    from moe_plugin.groups.builder import build_process_groups

    case = CASES2["tp2-ep2/gshard-drop"]
    groups = build_process_groups(RankLayout.build(world_size, **case["sizes"]))
    with pytest.raises(ValueError, match=r"moe.parallel.expert is 1 but the process groups .* have size 2"):
        MoELayer(MoEConfig.from_dict({"num_experts": E, "parallel": {"tensor": 2}}), H, F, groups)
    layer = _layer(case, world_size, groups)
    x = torch.randn(S, B, H)
    x[-1, 0, 0] = float("inf")       # replicated over TP (no SP): in rank 1's share of the tokens
    layer(x)


@pytest.mark.slow
def test_non_finite_input_raises_in_the_parent(dist_run):
    with pytest.raises(ValueError, match=NAN_MESSAGE.format(1)):
        dist_run(_failing_child, 2, timeout=60)


def test_source_to_expert_order():
    from moe_plugin.layers import source_to_expert_order

    counts_SL = torch.tensor([[2, 0, 1], [1, 3, 0]])    # source 0: l0 l0 l2; source 1: l0 l1 l1 l1
    rows = torch.tensor([0, 1, 2, 10, 11, 12, 13])
    sort, unsort = source_to_expert_order(counts_SL)
    assert rows[sort].tolist() == [0, 1, 10, 11, 12, 13, 2]
    assert torch.equal(rows[sort][unsort], rows)
    empty = source_to_expert_order(torch.zeros(2, 3, dtype=torch.long))
    assert [t.numel() for t in empty] == [0, 0]


def _count_collectives(rank: int, world_size: int) -> dict:
    """The collectives one training forward of an EP layer makes, per kind and group size, in
    a layout where EP is every token group (ep4) and in one where it is not (ep2 x dp2)."""
    from unittest import mock

    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    counts = {}
    for name, sizes in (("ep4", dict(ep=4)), ("ep2-dp2", dict(ep=2)), ("ep4-padded", dict(ep=4)),
                        ("ep2-dp2-padded", dict(ep=2))):
        groups = build_process_groups(RankLayout.build(world_size, **sizes))
        try:
            case = CASES4["ep4/gshard-drop"]
            moe = {**case["moe"], "exchange": "padded" if name.endswith("padded") else "counts"}
            layer = _layer(dict(case, sizes=sizes, moe=moe), world_size, groups)
            calls = []

            def spy(real, kind):
                def call(*args, group=None, **kwargs):
                    calls.append((kind, dist.get_world_size(group)))
                    return real(*args, group=group, **kwargs)
                return call

            with mock.patch.multiple(dist, all_reduce=spy(dist.all_reduce, "all_reduce"),
                                     all_gather=spy(dist.all_gather, "all_gather"),
                                     all_to_all_single=spy(dist.all_to_all_single, "all_to_all")):
                layer(torch.randn(S, B, H))
            counts[name] = sorted(calls)
        finally:
            destroy_process_groups(groups)
    return counts


@pytest.mark.slow
def test_collectives_per_forward(dist_run):
    """ep4 on 4 ranks: the counts exchange carries the finite check (no all-reduce of its own):
    three all-to-alls over the 4 EP ranks (counts, rows out, rows back). ep2 x dp2: the finite
    flags go to the 4 token groups in one all-to-all (started without waiting), then the same
    three all-to-alls over the 2 EP ranks. No ring collective (all-reduce, all-gather) at all.
    The padded exchange (``exchange`` padded) runs no counts all-to-all: two over EP."""
    for counts in dist_run(_count_collectives, 4):
        assert counts["ep4"] == [("all_to_all", 4)] * 3
        assert counts["ep2-dp2"] == [("all_to_all", 2)] * 3 + [("all_to_all", 4)]
        assert counts["ep4-padded"] == [("all_to_all", 4)] * 2
        assert counts["ep2-dp2-padded"] == [("all_to_all", 2)] * 2 + [("all_to_all", 4)]
