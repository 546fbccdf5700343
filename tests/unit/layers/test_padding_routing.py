"""Padding is not routed, and documents are the sequences of the balance loss
(``MoELayer.forward(document_T=...)``, ``MegatronMoEMLP.forward(padding_mask=...)``).

One process: a batch with padding (NaN in its padding rows) gives, on its real rows, the outputs,
losses, counts, capacity, bias update and gradients of the same real tokens without padding, and
zero on the padding rows; ids that mark every token real change nothing, bit for bit; a pack of two
conversations with aux_loss_scope sequence gives the mean of their losses apart; the layer against
the oracle with documents; ``MegatronMoEMLP``'s padding_mask in both dtypes; one host sync.
Ranks (one spawn of 2, one of 4): tp2, tp2 with sequence parallelism, dp2 x ep2 (counts and padded
exchange, the global scope), tp2 x ep2 and tp2sp x ep2 against the oracle (each replica its own
padding), and a Megatron-Core GPT given padding_mask under tp2 with sequence parallelism against one
rank. fp32, atol = rtol = 1e-5 against the oracle, 1e-6 between the layer's own runs.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist import attempts, case_results, run_distributed
from moe_plugin.configs import MoEConfig
from moe_plugin.configs.capacity import expert_capacity
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer, RouterNoise, reference_moe
from moe_plugin.layers.router import capacity_of
from tests.unit.layers.test_layers_single import B, E, F, H, S, TOL, capacity_if_dropping, check_against_oracle, make_layer, tokens

CLOSE = dict(atol=1e-6, rtol=1e-6)
COEFF = 0.1

# The cases of "as if the padding were not there" (one process); drop ones must drop routes.
SINGLE = {
    "gshard-jitter-drop": dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=COEFF,
                               bias_update_rate=0.1),
    "topk3-probability-drop": dict(router="topk", top_k=3, drop_policy="probability", capacity_factor=0.5,
                                   aux_loss_coeff=COEFF, z_loss_coeff=1e-3),
    "sigmoid2-dropless-shared": dict(router="topk", top_k=2, score_function="sigmoid", drop_tokens=False,
                                     aux_loss_coeff=COEFF, bias_update_rate=0.1, activation="swiglu",
                                     shared_expert_ffn_hidden_size=8, shared_expert_gate=True),
    "switch-global-drop": dict(router="switch", aux_loss_scope="global", aux_loss_coeff=COEFF, z_loss_coeff=1e-2),
}


def padded(s: int = S, b: int = B, seed: int = 3, share: float = 0.3):
    """(x [s, b, H] with NaN on padding, document_T [s * b]: column b's tokens are document b, -1 padding)."""
    gen = torch.Generator().manual_seed(seed)
    pad_SB = torch.rand(s, b, generator=gen) < share
    pad_SB[-1] = True                                      # every column ends in padding
    document_T = torch.where(pad_SB, -1, torch.arange(b)).reshape(-1)
    x = tokens(s, b, seed=seed + 1)
    x.view(-1, H)[document_T < 0] = float("nan")
    return x, document_T


def _noise(moe: dict, T: int, gen: torch.Generator) -> RouterNoise:
    """Jitter and U(0, 1) for T tokens where the router uses them."""
    config = make_layer(**moe).config
    jitter = torch.rand(T, H, generator=gen) * 0.2 + 0.9 if config.jitter_eps > 0 else None
    uniform = torch.rand(T, generator=gen) if config.router == "gshard" else None
    return RouterNoise(jitter_TH=jitter, uniform_T=uniform)


def _step(layer: MoELayer, x: torch.Tensor, noise: RouterNoise, grad: torch.Tensor, document_T=None) -> dict:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x, noise=noise, document_T=document_T)
    (out * grad).sum().backward()
    stats = layer.last_stats
    load = layer.router.load_E.clone()
    layer.update_expert_bias()
    return {"out": out.detach().reshape(-1, H), "x_grad": x.grad.reshape(-1, H), "stats": stats, "load": load,
            "bias": layer.router.expert_bias.clone(),
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("name", list(SINGLE))
def test_padding_is_as_if_it_were_not_there(name):
    moe = SINGLE[name]
    x, document_T = padded()
    real = (document_T >= 0).nonzero().flatten()
    n, T = real.numel(), document_T.numel()
    gen = torch.Generator().manual_seed(9)
    noise = _noise(moe, T, gen)
    grad = torch.randn(T, H, generator=gen)
    with_padding = _step(make_layer(**moe).train(), x, noise, grad.view(x.shape), document_T)
    alone = _step(make_layer(**moe).train(), x.reshape(-1, H)[real].view(n, 1, H),
                  RouterNoise(*(None if r is None else r[real] for r in (noise.jitter_TH, noise.uniform_T))),
                  grad[real].view(n, 1, H))

    a, b = with_padding, alone
    torch.testing.assert_close(a["out"][real], b["out"], **CLOSE)
    assert torch.equal(a["out"][document_T < 0], torch.zeros(T - n, H)), "padding rows must be zero"
    torch.testing.assert_close(a["x_grad"][real], b["x_grad"], **CLOSE)
    assert torch.equal(a["x_grad"][document_T < 0], torch.zeros(T - n, H))
    for what in ("balance_loss", "z_loss", "dropped_fraction"):
        torch.testing.assert_close(getattr(a["stats"], what), getattr(b["stats"], what), **CLOSE)
    assert a["stats"].kept_per_expert.tolist() == b["stats"].kept_per_expert.tolist()
    assert a["stats"].routed_per_expert.tolist() == b["stats"].routed_per_expert.tolist()
    assert a["stats"].capacity == b["stats"].capacity
    assert torch.equal(a["load"], b["load"]) and torch.equal(a["bias"], b["bias"])
    assert a["grads"].keys() == b["grads"].keys()
    for key in a["grads"]:
        torch.testing.assert_close(a["grads"][key], b["grads"][key], **CLOSE, msg=lambda m: f"{key}: {m}")
    if moe.get("drop_tokens", True):
        k = make_layer(**moe).config.k
        assert a["stats"].capacity == expert_capacity(n, E, k, moe.get("capacity_factor", 1.0), 1)
        assert a["stats"].capacity < expert_capacity(T, E, k, moe.get("capacity_factor", 1.0), 1)
        assert float(a["stats"].dropped_fraction) > 0, "the case should drop routes"
    assert int(a["load"].sum()) == int(a["stats"].routed_per_expert.sum()) > 0


@pytest.mark.parametrize("moe", [dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=COEFF),
                                 dict(router="topk", top_k=2, drop_tokens=False, aux_loss_coeff=COEFF,
                                      shared_expert_ffn_hidden_size=8),
                                 dict(router="topk", top_k=2, score_function="sigmoid", aux_loss_coeff=COEFF,
                                      aux_loss_scope="sequence", drop_tokens=False),
                                 dict(router="switch", aux_loss_coeff=COEFF, aux_loss_scope="global")],
                         ids=["micro-batch-drop", "dropless-shared", "sequence", "global"])
def test_every_token_real_changes_nothing(moe):
    """Ids that mark every token real (one document per column) give today's forward, bit for bit."""
    x, T = tokens(), S * B
    gen = torch.Generator().manual_seed(9)
    noise = _noise(moe, T, gen)
    grad = torch.randn(S, B, H, generator=gen)
    runs = [_step(make_layer(**moe).train(), x, noise, grad, ids) for ids in (None, torch.arange(T) % B)]
    for key in ("out", "x_grad", "load", "bias"):
        assert torch.equal(runs[0][key], runs[1][key]), key
    for key in runs[0]["grads"]:
        assert torch.equal(runs[0]["grads"][key], runs[1]["grads"][key]), key
    for what in ("balance_loss", "z_loss", "kept_per_expert", "routed_per_expert"):
        assert torch.equal(getattr(runs[0]["stats"], what), getattr(runs[1]["stats"], what)), what
    assert runs[0]["stats"].capacity == runs[1]["stats"].capacity


def _aux(layer: MoELayer, x: torch.Tensor, document_T=None):
    """(balance loss, z-loss, router-weight gradient of the attached losses alone) of one training forward."""
    layer.router.weight.grad = None
    out, _ = layer(x, document_T=document_T)
    (out * 0).sum().backward()
    return layer.last_stats.balance_loss, layer.last_stats.z_loss, layer.router.weight.grad.clone()


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_a_pack_of_two_conversations_is_two_sequences(score):
    """aux_loss_scope sequence on one column holding conversations 0 (5 tokens) and 1 (7), then 4 of
    padding: the balance loss is the mean of theirs run apart, each its own batch (the z-loss the mean
    over the 12 tokens), not the pack's as one sequence (Megatron-LM #6108)."""
    layer = make_layer(router="topk", top_k=2, score_function=score, aux_loss_coeff=COEFF, aux_loss_scope="sequence",
                       drop_tokens=False).train()
    first, second = tokens(5, 1, seed=4), tokens(7, 1, seed=5)
    pack = torch.cat([first, second, torch.full((4, 1, H), float("nan"))])
    document_T = torch.tensor([0] * 5 + [1] * 7 + [-1] * 4)
    loss, z, grad = _aux(layer, pack, document_T)
    apart = [_aux(layer, part) for part in (first, second)]
    torch.testing.assert_close(loss, (apart[0][0] + apart[1][0]) / 2, **CLOSE)
    torch.testing.assert_close(z, (5 * apart[0][1] + 7 * apart[1][1]) / 12, **CLOSE)
    torch.testing.assert_close(grad, (apart[0][2] + apart[1][2]) / 2, **CLOSE)
    one_sequence, _, _ = _aux(layer, pack, torch.where(document_T >= 0, 0, -1))
    assert not torch.allclose(one_sequence, loss, atol=1e-4), "the case should tell a pack from its documents"


@pytest.mark.parametrize("moe", [dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=COEFF),
                                 dict(router="topk", top_k=3, aux_loss_scope="sequence", aux_loss_coeff=COEFF,
                                      drop_policy="probability", capacity_factor=0.5),
                                 dict(router="topk", top_k=2, score_function="sigmoid", aux_loss_scope="sequence",
                                      aux_loss_coeff=COEFF, drop_tokens=False, shared_expert_ffn_hidden_size=8)],
                         ids=["gshard", "sequence-probability", "sequence-sigmoid-shared"])
def test_documents_and_padding_match_the_oracle(moe):
    """Documents across columns (ids in row order s * B + b, one spanning both columns), padding
    inside and at the end: the layer against ``reference_moe(document_T=...)``."""
    document_T = torch.tensor([0, 1, 2, 3] * 2 + [0, 4, 5, 5] * 3 + [-1, 4, 5, -1] + [-1, 6, -1, -1] * 2)
    x = tokens().reshape(-1, H)
    x[document_T < 0] = float("nan")
    check_against_oracle(make_layer(**moe), x.view(S, B, H), document_T=document_T)


def test_device_capacity_is_the_exact_formula():
    for factor in (0.3, 1.0, 1.1, 1.25, 2.2):
        for k, experts in ((1, 8), (2, 8), (3, 64)):
            counts = torch.arange(0, 600).reshape(-1, 1)
            got = capacity_of(counts, experts, k, factor, 2).flatten().tolist()
            assert got == [expert_capacity(n, experts, k, factor, 2) for n in range(600)], (factor, k, experts)


def test_document_ids_must_be_one_integer_per_row():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"document_T must be integer document ids \[32\] .* got torch.int64 \[8, 4\]"):
        layer(tokens(), document_T=torch.zeros(S, B, dtype=torch.long))
    with pytest.raises(ValueError, match=r"document_T must be integer .* got torch.bool \[32\]"):
        layer(tokens(), document_T=torch.zeros(S * B, dtype=torch.bool))


@pytest.mark.parametrize("moe", [dict(router="topk", top_k=2), dict(router="topk", top_k=2, drop_tokens=False,
                                                                    aux_loss_scope="sequence", aux_loss_coeff=COEFF)])
def test_one_host_sync_with_padding(moe):
    """With documents the forward still syncs once (the real tokens' capacity is read there), the
    backward never, and the steady state copies nothing to the device."""
    from tests.unit.layers.test_host_syncs import SyncCounter

    layer, counter = make_layer(**moe).train(), SyncCounter()
    x, document_T = padded()
    for _ in range(2):
        with counter:
            out, _ = layer(x.clone().requires_grad_(True), document_T=document_T)
        forward, uploads = counter.take(), counter.take_uploads()
        with counter:
            out.sum().backward()
        assert len(forward) == 1 and not counter.take(), forward
    assert not uploads and not counter.take_uploads(), uploads


def _megatron_mlp(**moe):
    from megatron.core.transformer import TransformerConfig

    from moe_plugin.integration.megatron import MegatronMoEMLP

    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=F,
                               use_cpu_initialization=True)
    block = capacity_if_dropping({"num_experts": E, "router": "topk", "top_k": 2, "aux_loss_coeff": COEFF, **moe})
    return MegatronMoEMLP(config, moe_config=MoEConfig.from_dict(block), layer_index=1).train()


@pytest.mark.parametrize("scope", ["micro_batch", "sequence"])
def test_megatron_padding_mask_in_both_dtypes(scope):
    """Megatron's [B, S] padding_mask: bool, True on padding (each column a sequence), or integer
    document ids, -1 on padding: ``MoELayer.forward`` with those documents in row order s * B + b.
    All False: no padding, today's forward bit for bit."""
    mlp = _megatron_mlp(aux_loss_scope=scope)
    x, document_T = padded()
    ids_BS = document_T.view(S, B).t()
    runs = []
    for kind in ("document_T", "bool", "ids"):
        gen = mlp.router.generator(torch.device("cpu"))
        state = gen.get_state()
        if kind == "document_T":
            out, _ = MoELayer.forward(mlp, x, document_T=document_T)
        else:
            out, bias = mlp(x, padding_mask=ids_BS < 0 if kind == "bool" else ids_BS * 7 + 2 * (ids_BS < 0))
            assert bias is None
        gen.set_state(state)
        runs.append((out, mlp.last_stats.balance_loss, mlp.last_stats.routed_per_expert))
    for got in runs[1:]:
        for a, b in zip(runs[0], got):
            assert torch.equal(a, b)
    assert torch.equal(runs[0][0].reshape(-1, H)[document_T < 0], torch.zeros(int((document_T < 0).sum()), H))
    clean = tokens()
    state = mlp.router.generator(torch.device("cpu")).get_state()
    none, _ = mlp(clean)
    mlp.router.generator(torch.device("cpu")).set_state(state)
    all_real, _ = mlp(clean, padding_mask=torch.zeros(B, S, dtype=torch.bool))
    assert torch.equal(none, all_real)
    with pytest.raises(ValueError, match=r"padding_mask must be \[batch, sequence\] = \[4, 8\] .* got torch.bool "
                                         r"\[8, 4\]"):
        mlp(clean, padding_mask=torch.zeros(S, B, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"padding_mask must be .* got torch.float32 \[4, 8\]"):
        mlp(clean, padding_mask=torch.zeros(B, S))


# -- layouts -----------------------------------------------------------------------------------------
DS, DB, DF = 8, 2, 16                  # per DP replica: T = 16 tokens; DF: the F test_layers_dist's _expert_slice cuts
ROUTERS = {
    "gshard": dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=COEFF),
    "topk3": dict(router="topk", top_k=3, aux_loss_coeff=COEFF, z_loss_coeff=1e-3),
    "sequence": dict(router="topk", top_k=2, score_function="sigmoid", aux_loss_scope="sequence",
                     aux_loss_coeff=COEFF, z_loss_coeff=1e-3),
    "shared": dict(router="switch", activation="swiglu", shared_expert_ffn_hidden_size=8, shared_expert_gate=True,
                   aux_loss_coeff=COEFF, bias_update_rate=0.1),
    "global": dict(router="topk", top_k=2, aux_loss_scope="global", aux_loss_coeff=COEFF),
}
# name -> (RankLayout.build sizes, sequence parallel, router, drop_tokens, extra moe fields)
CASES2 = {
    "tp2/gshard": (dict(tp=2, etp=1), False, "gshard", True, {}),
    "tp2/sequence": (dict(tp=2, etp=1), False, "sequence", False, {}),
    "tp2sp/topk3": (dict(tp=2, etp=1), True, "topk3", True, {}),
    "tp2sp/sequence": (dict(tp=2, etp=1), True, "sequence", True, {}),
    "dp2-ep2/gshard": (dict(ep=2), False, "gshard", True, {}),
    "dp2-ep2/gshard-padded": (dict(ep=2), False, "gshard", True, {"exchange": "padded"}),
    "dp2-ep2/shared": (dict(ep=2), False, "shared", False, {}),
    "dp2-ep2/sequence": (dict(ep=2), False, "sequence", True, {}),
    "dp2-ep2/global": (dict(ep=2), False, "global", False, {}),
}
CASES4 = {
    "tp2-ep2-dp2/gshard": (dict(tp=2, ep=2, etp=1), False, "gshard", True, {}),
    "tp2-ep2-dp2/shared": (dict(tp=2, ep=2, etp=1), False, "shared", False, {}),
    "tp2sp-ep2-dp2/sequence": (dict(tp=2, ep=2, etp=1), True, "sequence", True, {}),
    "tp2sp-ep2-dp2/topk3-padded": (dict(tp=2, ep=2, etp=1), True, "topk3", True, {"exchange": "padded"}),
}


def _config(case: tuple, world_size: int | None = None) -> MoEConfig:
    sizes, sp, router, drop, extra = case
    block = {"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1, **ROUTERS[router], "drop_tokens": drop,
             **extra}
    if world_size is None:
        block.pop("exchange", None)
    else:
        s = RankLayout.build(world_size, **sizes).sizes
        block["parallel"] = {"tensor": s.tp, "expert": s.ep, "expert_tensor": s.etp, "sequence_parallel": sp}
    return MoEConfig.from_dict(capacity_if_dropping(block))


def _inputs(config: MoEConfig, dp: int):
    """Every replica's tokens [dp, S, B, H] (NaN on padding), documents [dp, S, B] (each replica its
    own: packs, one document across both columns, different amounts of padding), upstream gradients,
    noise for all tokens."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(dp, DS, DB, H, generator=gen)
    docs = torch.tensor([[0, 1], [0, 1], [0, 1], [2, 1], [2, 3], [2, -1], [-1, -1], [-1, -1]])
    docs = torch.stack([torch.where(docs >= 0, docs + 10 * d, -1) for d in range(dp)])
    for d in range(1, dp):                                  # other replicas: other padding, 3 more real tokens
        docs[d, 1, 1] = -1
        docs[d, -2:] = torch.tensor([10 * d + 2, 10 * d + 3])
    x[docs < 0] = float("nan")
    grad = torch.randn(dp, DS, DB, H, generator=gen)
    T = dp * DS * DB
    jitter = torch.rand(T, H, generator=gen) * 0.2 + 0.9 if config.jitter_eps > 0 else None
    uniform = torch.rand(T, generator=gen) if config.router == "gshard" else None
    return x, docs, grad, jitter, uniform


def _run(rank: int, groups, case: tuple) -> dict:
    sizes, sp = case[0], case[1]
    layout = groups.layout
    tp, dp, c = layout.sizes.tp, layout.sizes.dp, layout.coords(rank)
    layer = MoELayer(_config(case, layout.world_size), H, DF, groups, seed=3, init_std=0.3).train()
    x_all, docs_all, grad_all, jitter, uniform = _inputs(layer.config, dp)
    x, docs, grad = x_all[c["dp"]], docs_all[c["dp"]], grad_all[c["dp"]]
    if sp:
        x, docs, grad = x.chunk(tp)[c["tp"]], docs.chunk(tp)[c["tp"]], grad.chunk(tp)[c["tp"]]
    rows = slice(c["dp"] * DS * DB, (c["dp"] + 1) * DS * DB)
    noise = RouterNoise(jitter_TH=None if jitter is None else jitter[rows],
                        uniform_T=None if uniform is None else uniform[rows])
    x = x.clone().requires_grad_(True)
    out, _ = layer(x, noise=noise, document_T=docs.reshape(-1))
    (out * grad).sum().backward()
    grads = {}
    for name, p in layer.named_parameters():          # DeepSpeed's convention
        g = p.grad.detach().clone()
        reduce_group = groups.edp if getattr(p, "allreduce", True) is False else groups.dp
        if reduce_group is not None:
            dist.all_reduce(g, group=reduce_group)
            g /= dist.get_world_size(reduce_group)
        grads[name] = g
    stats = layer.last_stats
    result = {"out": out.detach(), "x_grad": x.grad, "grads": grads, "balance": stats.balance_loss,
              "z": stats.z_loss, "capacity": stats.capacity, "global": layer.global_stats()}
    layer.update_expert_bias()
    result["bias"] = layer.router.expert_bias.clone()
    return result


def _layouts_child(rank: int, world_size: int, cases: dict) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    results: dict = {}
    attempt = attempts(results, rank)
    by_layout: dict = {}
    for name, case in cases.items():
        by_layout.setdefault((str(case[0]), case[1]), []).append(name)
    for names in by_layout.values():
        groups = build_process_groups(RankLayout.build(world_size, **cases[names[0]][0]))
        try:
            for name in names:
                attempt(name, _run, rank, groups, cases[name])
        finally:
            destroy_process_groups(groups)
    if world_size == 2:
        attempt("gpt", _gpt_child, rank, world_size)
    return results


def _closeness(rank: int):
    """``close(actual, expected, what)`` at ``TOL``, its message naming the rank."""
    def close(actual, expected, what):
        torch.testing.assert_close(actual.float(), expected.float(), **TOL, msg=lambda m: f"rank {rank} {what}: {m}")
    return close


def _check_layout(case: tuple, world_size: int, results: list) -> None:
    from tests.unit.layers.test_layers_dist import _expert_slice

    sizes, sp = case[0], case[1]
    layout = RankLayout.build(world_size, **sizes)
    tp, dp = layout.sizes.tp, layout.sizes.dp
    config = _config(case)
    single = MoELayer(config, H, DF, seed=3, init_std=0.3).train()
    x_all, docs_all, grad_all, jitter, uniform = _inputs(config, dp)
    T = DS * DB
    if config.aux_loss_scope == "global":     # one process routes the global batch (replicas side by side)
        return _check_global(single, layout, results, x_all, docs_all, grad_all)
    params = {name: p.detach().clone().requires_grad_(True) for name, p in single.named_parameters()}
    params["router.expert_bias"] = single.router.expert_bias.clone()
    x_ref = x_all.reshape(-1, H).clone().requires_grad_(True)
    ref = reference_moe(x_ref, params, config, training=True, jitter_TH=jitter, uniform_T=uniform,
                        group_sizes=[T] * dp, document_T=docs_all.reshape(-1))
    ((ref.out * grad_all.reshape(-1, H)).sum() / dp + ref.weighted_aux_loss(config)).backward()
    if config.drop_tokens:
        assert sum(ref.kept_per_expert) < sum(ref.routed_per_expert), "the case should drop routes"
        assert dp == 1 or len(set(ref.capacities)) > 1, "the replicas should have their own capacities"
    for rank, result in enumerate(results):
        c = layout.coords(rank)
        d, n = c["dp"], T // tp
        rows = slice(d * T + c["tp"] * n, d * T + (c["tp"] + 1) * n) if sp else slice(d * T, (d + 1) * T)

        close = _closeness(rank)

        close(result["out"].reshape(-1, H), ref.out[rows].detach(), "output")
        close(result["x_grad"].reshape(-1, H), x_ref.grad[rows] * dp, "input gradient")
        close(result["balance"], ref.group_balance_losses[d].detach(), "balance loss")
        close(result["z"], ref.group_z_losses[d].detach(), "z loss")
        assert result["capacity"] == ref.capacities[d], rank
        for name, grad in result["grads"].items():
            full = params[name].grad
            if name.startswith("experts."):
                full = _expert_slice(name, full, c, layout.sizes, config.activation)
            close(grad, full, f"{name} gradient")
        assert result["global"].kept_per_expert.tolist() == ref.kept_per_expert, rank
        assert result["global"].routed_per_expert.tolist() == ref.routed_per_expert, rank
        load = torch.tensor(ref.routed_per_expert, dtype=torch.float32)
        assert torch.equal(result["bias"], config.bias_update_rate * torch.sign(load.mean() - load)), rank


def _check_global(single, layout, results, x_all, docs_all, grad_all) -> None:
    """aux_loss_scope global, replicas with different real-token counts: the balance loss averaged
    over the ranks, every output and gradient equal one process routing the global batch."""
    from tests.unit.layers.test_layers_dist import _expert_slice

    dp = layout.sizes.dp
    whole = lambda t: t.transpose(0, 1).reshape(DS, dp * DB, *t.shape[3:])     # [dp, S, B, ...] -> [S, dp * B, ...]
    x1 = whole(x_all).clone().requires_grad_(True)
    out1, _ = single(x1, document_T=whole(docs_all).reshape(-1))
    (out1 * whole(grad_all)).sum().div(dp).backward()
    assert docs_all[0].ge(0).sum() != docs_all[1].ge(0).sum(), "the replicas should differ in real tokens"
    for rank, result in enumerate(results):
        c = layout.coords(rank)
        mine = lambda t: t.view(DS, dp, DB, -1)[:, c["dp"]].reshape(-1, t.shape[-1])

        close = _closeness(rank)

        close(result["out"].reshape(-1, H), mine(out1.detach()), "output")
        close(result["x_grad"].reshape(-1, H), mine(x1.grad) * dp, "input gradient")
        close(result["global"].balance_loss, single.last_stats.balance_loss, "balance loss (mean over ranks)")
        for name, grad in result["grads"].items():
            full = single.get_parameter(name).grad
            if name.startswith("experts."):
                full = _expert_slice(name, full, c, layout.sizes, single.config.activation)
            close(grad, full, f"{name} gradient")


def _gpt_child(rank: int, world_size: int) -> dict:
    """A Megatron-Core GPT given padding_mask [B, S]: on one rank (dp2) bool and integer masks alike,
    the MoE MLP's padding rows zero; under tp2 with sequence parallelism (GPTModel cuts the mask to
    the rank's positions) logits, loss and gradients of one rank; the whole mask given to the MLP
    of an SP rank (a later pipeline stage's case) cut alike."""
    from moe_plugin.checkpoint.reshard import shard_state_dict
    from moe_plugin.integration.megatron import gpt_moe_spec
    from moe_plugin.integration.seeding import seed_megatron_rng
    from moe_plugin.integration.sp_grads import allreduce_sequence_parallel_grads
    from tests.unit.integration.test_megatron_spec import VOCAB, _batch, _config as gpt_config, _drop, _gpt, _groups, _reduce_like_deepspeed

    block = {"num_experts": 4, "layers": [1], "router": "topk", "top_k": 2, "capacity_factor": 1.0,
             "min_capacity": 1, "aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3, "aux_loss_scope": "sequence"}
    ids, pos, labels = _batch()                                         # [2, 8]
    pad_BS = torch.zeros(ids.shape, dtype=torch.bool)
    pad_BS[0, -3:], pad_BS[1, -1:] = True, True
    docs_BS = torch.where(pad_BS, -1, torch.tensor([[5], [9]]))

    def step(model, mask, groups) -> dict:
        mlp = model.decoder.layers[1].mlp
        seen = []
        handle = mlp.register_forward_hook(lambda module, args, output: seen.append(output[0].detach()))
        logits = model(ids, pos, None, padding_mask=mask)
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=labels, padding_mask=mask).float().mean()
        loss.backward()
        handle.remove()
        allreduce_sequence_parallel_grads(model, groups)
        _reduce_like_deepspeed(model, groups)
        return {"logits": logits.detach(), "loss": loss.detach(), "mlp_out": seen[0],
                "routed": mlp.last_stats.routed_per_expert.sum(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}

    groups = _groups(world_size)                                        # dp2: one rank's model on each
    config = gpt_config()
    model = _gpt(gpt_moe_spec(MoEConfig.from_dict(block), config, groups), config)
    full_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    ref = {kind: step(model, mask, groups) for kind, mask in (("bool", pad_BS), ("ids", docs_BS))}
    _drop(groups)

    groups = _groups(world_size, tp=2, etp=1)
    moe = MoEConfig.from_dict({**block, "parallel": {"tensor": 2, "expert_tensor": 1, "sequence_parallel": True}})
    config = gpt_config(tp=2, sp=True)
    seed_megatron_rng(0, groups)
    model = _gpt(gpt_moe_spec(moe, config, groups), config)
    model.load_state_dict(shard_state_dict(full_state, model, groups.layout, rank))
    got = step(model, pad_BS, groups)
    tp_rank, vocab = groups.rank_in("tp"), VOCAB // 2
    mlp = model.decoder.layers[1].mlp
    x_SBH = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(2))   # this rank's 4 of 8 positions
    outs = [mlp(x_SBH, padding_mask=mask)[0].detach() for mask in (pad_BS.chunk(2, dim=1)[tp_rank], pad_BS)]
    _drop(groups)
    return {"ref": ref, "got": got, "ref_logits": ref["bool"]["logits"][..., tp_rank * vocab:(tp_rank + 1) * vocab],
            "ref_grads": shard_state_dict(ref["bool"]["grads"], model, groups.layout, rank, strict=False),
            "pad_SB": pad_BS.t(), "cut_and_whole": outs}


@pytest.fixture(scope="module")
def layouts2(tmp_path_factory):
    return run_distributed(_layouts_child, 2, tmp_path_factory.mktemp("padding2"), CASES2, timeout=240)


@pytest.fixture(scope="module")
def layouts4(tmp_path_factory):
    return run_distributed(_layouts_child, 4, tmp_path_factory.mktemp("padding4"), CASES4, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES2))
def test_layouts_on_2_ranks(name, layouts2):
    _check_layout(CASES2[name], 2, case_results(layouts2, name))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES4))
def test_layouts_on_4_ranks(name, layouts4):
    _check_layout(CASES4[name], 4, case_results(layouts4, name))


@pytest.mark.slow
def test_megatron_gpt_padding_mask_under_sequence_parallelism(layouts2):
    gpt_tol = dict(rtol=1e-4, atol=1e-5)
    for rank, out in enumerate(case_results(layouts2, "gpt")):
        ref, got = out["ref"], out["got"]
        for key in ("logits", "loss", "mlp_out"):
            assert torch.equal(ref["bool"][key], ref["ids"][key]), f"rank {rank}: {key}: bool and ids differ"
        pad_SB = out["pad_SB"]
        assert torch.equal(ref["bool"]["mlp_out"][pad_SB], torch.zeros(int(pad_SB.sum()), 32)), "padding rows"
        assert ref["bool"]["mlp_out"][~pad_SB].abs().sum() > 0
        assert int(ref["bool"]["routed"]) == 2 * int((~pad_SB).sum()), "top-2 routes of the real tokens only"
        torch.testing.assert_close(got["loss"], ref["bool"]["loss"], **gpt_tol, msg=f"rank {rank}: loss")
        torch.testing.assert_close(got["logits"], out["ref_logits"], **gpt_tol, msg=f"rank {rank}: logits")
        assert set(got["grads"]) == set(out["ref_grads"])
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, out["ref_grads"][name], **gpt_tol, msg=f"rank {rank}: {name}")
        cut, whole = out["cut_and_whole"]
        assert torch.equal(cut, whole), f"rank {rank}: the whole mask cut to the rank's positions"
