"""MoELayer in one process against the loop oracle ``reference_moe``.

Every comparison covers the output, the balance and z losses, the kept/routed counts and
every gradient (router.weight, experts.weight1/weight2, shared expert, the input), fp32 at
atol = rtol = 1e-5 unless stated.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_plugin_tools.bench.memory import memory_profile
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.layers import GroupedExperts, MoELayer, RouterNoise, expert_capacity, reference_moe, route

S, B, H, F, E = 8, 4, 16, 32, 8
TOL = dict(atol=1e-5, rtol=1e-5)


CAPACITY_KEYS = ("capacity_factor", "eval_capacity_factor", "min_capacity", "drop_policy")


def capacity_if_dropping(block: dict) -> dict:
    """``block`` without the capacity fields when it is dropless (``drop_tokens`` false): the config
    refuses them there, as nothing reads them."""
    if block.get("drop_tokens", True):
        return block
    return {key: value for key, value in block.items() if key not in CAPACITY_KEYS}


def make_layer(seed: int = 0, hidden: int = H, ffn: int = F, placement=None, **moe) -> MoELayer:
    config = MoEConfig.from_dict(capacity_if_dropping({"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1,
                                                       **moe}))
    # init_std 0.3: logits of order 1 and outputs of order 1, so the tolerance means something.
    return MoELayer(config, hidden, ffn, seed=seed, init_std=0.3, placement=placement)


def tokens(s: int = S, b: int = B, hidden: int = H, seed: int = 1) -> torch.Tensor:
    return torch.randn(s, b, hidden, generator=torch.Generator().manual_seed(seed))


def check_against_oracle(layer: MoELayer, x_SBH: torch.Tensor, *, training: bool = True, tol=TOL,
                         oracle_dtype=None, noise=None, document_T=None):
    """Run layer and oracle on the same weights and random numbers (and documents, -1 padding:
    ``document_T``); compare everything."""
    layer.train(training)
    T = x_SBH.shape[0] * x_SBH.shape[1]
    if training and noise is None:
        noise = layer.router.draw_noise(T, layer.hidden_size)
    x = x_SBH.clone().requires_grad_(True)
    out, bias = layer(x, noise=noise, document_T=document_T)
    assert bias is None and out.shape == x.shape and out.dtype == x.dtype
    grad_SBH = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * grad_SBH).sum().backward()

    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    params["router.expert_bias"] = layer.router.expert_bias.clone()
    x_ref = x_SBH.detach().clone().to(oracle_dtype or x_SBH.dtype).requires_grad_(True)
    ref = reference_moe(x_ref.reshape(T, -1), params, layer.config, training=training,
                        jitter_TH=noise.jitter_TH if noise else None, uniform_T=noise.uniform_T if noise else None,
                        document_T=document_T)
    ref_loss = (ref.out.float() * grad_SBH.reshape(T, -1).float()).sum()
    if training:
        ref_loss = ref_loss + ref.weighted_aux_loss(layer.config)
    ref_loss.backward()

    stats = layer.last_stats
    torch.testing.assert_close(out.float().reshape(T, -1), ref.out.float().detach(), **tol)
    torch.testing.assert_close(stats.balance_loss, ref.balance_loss.detach(), **TOL)
    torch.testing.assert_close(stats.z_loss, ref.z_loss.detach(), **TOL)
    assert stats.kept_per_expert.tolist() == ref.kept_per_expert
    assert stats.routed_per_expert.tolist() == ref.routed_per_expert
    assert stats.capacity == ref.capacities[0]
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad.to(p.grad.dtype), **tol, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), **tol)
    return stats, ref


ROUTERS = {
    "gshard-random": dict(router="gshard", jitter_eps=0.1, z_loss_coeff=1e-2, aux_loss_coeff=0.1),
    "gshard-all": dict(router="gshard", second_expert_policy="all", aux_loss_coeff=0.1),
    "switch": dict(router="switch", z_loss_coeff=1e-2, aux_loss_coeff=0.1),
    "topk3-normalized": dict(router="topk", top_k=3, aux_loss_coeff=0.1),
    "topk3-raw": dict(router="topk", top_k=3, normalize_gates=False, z_loss_coeff=1e-3),
    "sigmoid2-normalized": dict(router="topk", top_k=2, score_function="sigmoid", gate_scale=2.5, aux_loss_coeff=0.1,
                                z_loss_coeff=1e-3),
    "sigmoid4-raw": dict(router="topk", top_k=4, score_function="sigmoid", normalize_gates=False, gate_scale=0.5,
                         aux_loss_coeff=0.1),
    "probability-top1": dict(router="switch", drop_policy="probability", capacity_factor=0.5, aux_loss_coeff=0.1),
    "probability-top2": dict(router="topk", top_k=2, drop_policy="probability", capacity_factor=0.5,
                             gate_scale=1.5, z_loss_coeff=1e-3),
    "grouped-sigmoid3": dict(router="topk", top_k=3, score_function="sigmoid", router_groups=4, group_topk=2,
                             gate_scale=2.5, aux_loss_coeff=0.1),
    "grouped-gshard": dict(router="gshard", router_groups=2, group_topk=1, jitter_eps=0.1, aux_loss_coeff=0.1),
}


@pytest.mark.parametrize("drop", [True, False], ids=["dropping", "dropless"])
@pytest.mark.parametrize("kind", list(ROUTERS))
def test_router_kinds_match_oracle(kind, drop):
    stats, _ = check_against_oracle(make_layer(drop_tokens=drop, **ROUTERS[kind]), tokens())
    if drop:
        assert float(stats.dropped_fraction) > 0, "the case should exercise capacity dropping"
    else:
        assert stats.capacity is None and float(stats.dropped_fraction) == 0


def test_random_routing_drops_some_second_choices():
    layer = make_layer(router="gshard", drop_tokens=False)
    stats, _ = check_against_oracle(layer, tokens())
    assert 32 < int(stats.routed_per_expert.sum()) < 64


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_activations_match_oracle(activation):
    check_against_oracle(make_layer(activation=activation), tokens())


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("backend", ["loop", "bmm"])
def test_gpt_oss_experts_match_oracle(recompute, backend):
    """GPT-OSS's clamped SwiGLU (a clamp low enough to cut: both the gate's and the up half's bounds are
    reached), expert biases and the router's logit bias, all non-zero, against the oracle."""
    layer = make_layer(activation="clamped_swiglu", swiglu_limit=0.5, swiglu_alpha=1.702, expert_linear_bias=True,
                       router_logit_bias=True, router="topk", top_k=2, drop_tokens=False, recompute_fc1=recompute,
                       experts_backend=backend)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (layer.router.bias, layer.experts.bias1, layer.experts.bias2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = tokens()
    pre = torch.einsum("th,ehf->tef", x.reshape(-1, H), layer.experts.weight1) + layer.experts.bias1
    gate, up = pre.chunk(2, dim=-1)
    assert (gate > 0.5).any() and (up < -0.5).any() and (up > 0.5).any(), "the clamp should cut"
    check_against_oracle(layer, x)
    for p in (layer.router.bias, layer.experts.bias1, layer.experts.bias2):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_clamped_swiglu_fields_belong_to_it():
    with pytest.raises(ConfigError, match="swiglu_limit"):
        MoEConfig.from_dict({"num_experts": E, "activation": "swiglu", "swiglu_limit": 5.0})


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_recompute_fc1_matches_oracle_and_keeps_less(activation):
    check_against_oracle(make_layer(activation=activation, recompute_fc1=True), tokens())
    kept = {}
    for recompute in (False, True):
        layer = make_layer(activation=activation, recompute_fc1=recompute, drop_tokens=False).train()
        assert layer.experts.recompute_pre_activation is recompute
        x = tokens(s=64).requires_grad_(True)
        kept[recompute] = memory_profile(lambda: layer(x)[0]).retained_bytes   # what backward would use
        routes = int(layer.last_stats.kept_per_expert.sum())
    width = 2 * F if activation == "swiglu" else F
    # the pre-activation of every kept route is what recompute_fc1 does not keep
    assert kept[False] - kept[True] == routes * width * 4


@pytest.mark.parametrize("drop", [True, False], ids=["dropping", "dropless"])
def test_placement_moves_experts_not_the_function(drop):
    placement = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])           # slot of expert e
    static, placed = (make_layer(drop_tokens=drop, **ROUTERS["topk3-normalized"], placement=p)
                      for p in (None, placement))
    assert torch.equal(placed.state_dict()["experts.placement"], placement)
    assert placed.local_experts() == torch.argsort(placement).tolist()
    assert torch.equal(placed.experts.weight1[placement], static.experts.weight1)   # expert e sits in slot p[e]
    runs = []
    for layer in (static, placed):
        x = tokens().requires_grad_(True)
        out, _ = layer(x)
        (out * tokens(seed=5)).sum().backward()
        runs.append((out, x.grad, layer.last_stats))
    (out0, gx0, st0), (out1, gx1, st1) = runs
    torch.testing.assert_close(out1, out0, **TOL)
    torch.testing.assert_close(gx1, gx0, **TOL)
    assert st1.kept_per_expert.tolist() == st0.kept_per_expert.tolist()
    assert torch.equal(st1.balance_loss, st0.balance_loss)
    for name in ("experts.weight1", "experts.weight2"):
        grad0, grad1 = static.get_parameter(name).grad, placed.get_parameter(name).grad
        torch.testing.assert_close(grad1[placement], grad0, **TOL)
    torch.testing.assert_close(placed.router.weight.grad, static.router.weight.grad, **TOL)


def test_placement_must_be_a_permutation():
    with pytest.raises(ValueError, match=r"placement must give each of the 8 experts its own slot"):
        make_layer(placement=[0, 1, 2, 3, 4, 5, 6, 6])


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "ungated"])
def test_shared_expert_matches_oracle(gate):
    layer = make_layer(shared_expert_ffn_hidden_size=24, shared_expert_gate=gate, activation="swiglu")
    assert (layer.shared_expert.gate_weight is not None) == gate
    check_against_oracle(layer, tokens())


def test_all_tokens_to_one_expert():
    layer = make_layer(router="gshard", second_expert_policy="all")
    x = tokens()
    x[..., 0] = 3.0
    with torch.no_grad():
        layer.router.weight[0, 0] = 10.0
    stats, _ = check_against_oracle(layer, x)
    capacity = expert_capacity(S * B, E, 2, 1.0, 1)
    assert stats.capacity == capacity
    assert int(stats.routed_per_expert[0]) == S * B and int(stats.kept_per_expert[0]) == capacity


def test_expert_without_tokens():
    layer = make_layer(router="gshard", second_expert_policy="all")
    layer.router.expert_bias[3] = -1e3       # choice only; gates still use the unbiased softmax
    stats, _ = check_against_oracle(layer, tokens())
    assert int(stats.routed_per_expert[3]) == 0
    assert layer.experts.weight1.grad[3].abs().max() == 0


@pytest.mark.parametrize("kind", ["gshard-random", "switch"])
def test_single_token(kind):
    check_against_oracle(make_layer(min_capacity=0, **ROUTERS[kind]), tokens(1, 1))


def test_gshard_priority_first_choices_before_second():
    # Tokens 0, 1 prefer expert 1, tokens 2, 3 expert 0; capacity 2 per expert. Expert 0's
    # slots go to the first choices of tokens 2, 3, not to the earlier second choices of 0, 1.
    logits_TE = torch.tensor([[0.0, 2.0], [0.0, 1.0], [3.0, 0.0], [1.0, 0.0]])
    plan = route(logits_TE, kind="gshard", k=2, normalize=True, capacity=2)
    assert plan.route_R.tolist() == [2, 3, 0, 1]       # route id = choice * T + token
    assert plan.token_R.tolist() == [2, 3, 0, 1]
    assert plan.kept_E.tolist() == [2, 2] and plan.routed_E.tolist() == [4, 4]
    assert float(plan.dropped_fraction) == 0.5
    # Within a choice, earlier tokens first: capacity 1 keeps token 2's first choice of expert 0.
    plan = route(logits_TE, kind="gshard", k=2, normalize=True, capacity=1)
    assert plan.route_R.tolist() == [2, 0]


def test_bf16_input():
    layer = make_layer(router="gshard", z_loss_coeff=1e-2)
    x = tokens().bfloat16()
    layer.train()
    noise = layer.router.draw_noise(S * B, H)
    out, _ = layer(x, noise=noise)
    assert out.dtype == torch.bfloat16 and layer.last_stats.balance_loss.dtype == torch.float32
    # Same routing as the fp32 oracle on the bf16-rounded input (the router runs in fp32);
    # only the expert GEMMs differ by bf16 rounding.
    loose = dict(atol=3e-2, rtol=3e-2)
    check_against_oracle(make_layer(router="gshard", z_loss_coeff=1e-2), x, tol=loose, oracle_dtype=torch.float32)
    layer = make_layer(router="gshard").bfloat16()
    out, _ = layer(x)
    assert out.dtype == torch.bfloat16 and layer.experts.weight1.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = tokens()
    x[3, 1, 5] = bad
    with pytest.raises(ValueError, match="MoE layer input .* contains NaN or inf"):
        make_layer()(x)


def test_uniform_routing_gives_balance_loss_one():
    layer = make_layer(router="topk", top_k=2)
    with torch.no_grad():
        layer.router.weight.zero_()          # every probability exactly 1/E
    layer(tokens())
    assert float(layer.last_stats.balance_loss) == 1.0
    # Uniform first choices with non-uniform probabilities: token t prefers expert t % E.
    layer = make_layer(router="switch")
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(E, H) * 2.0)
    x = torch.randn(4 * E, 1, H, generator=torch.Generator().manual_seed(3)) * 0.1
    x[torch.arange(4 * E), 0, torch.arange(4 * E) % E] = 3.0
    layer(x)
    assert float(layer.last_stats.balance_loss) == pytest.approx(1.0, abs=1e-6)


def test_aux_loss_gradient_reaches_router_through_output_alone():
    x, noise = tokens(), None
    grads = {}
    for coeff in (0.0, 0.5):
        layer = make_layer(router="gshard", aux_loss_coeff=coeff, z_loss_coeff=coeff / 10)
        noise = noise or layer.router.draw_noise(S * B, H)
        out, _ = layer(x, noise=noise)
        out.sum().backward()
        grads[coeff] = layer.router.weight.grad.clone()
    params = {n: p.detach().clone().requires_grad_(n == "router.weight") for n, p in layer.named_parameters()}
    ref = reference_moe(x.reshape(-1, H), params, layer.config, training=True,
                        jitter_TH=noise.jitter_TH, uniform_T=noise.uniform_T)
    ref.weighted_aux_loss(layer.config).backward()
    expected = params["router.weight"].grad
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(grads[0.5] - grads[0.0], expected, **TOL)


def test_aux_loss_free_bias_moves_load_toward_balance():
    layer = make_layer(router="topk", top_k=2, bias_update_rate=0.1, drop_tokens=False, aux_loss_coeff=0.0)
    x = tokens(16, 8).abs()
    with torch.no_grad():
        layer.router.weight[0] += 0.2        # expert 0 is hot for positive inputs
    layer.train()

    def imbalance() -> float:
        with torch.no_grad():
            layer(x)
        load = layer.last_stats.routed_per_expert.float()
        return float(load.max() / load.mean())

    first = imbalance()
    for _ in range(40):
        imbalance()
        layer.update_expert_bias()
    assert int(layer.router.load_E.sum()) == 0, "the update consumes the accumulated load"
    assert first == 4.0 and imbalance() < 1.5      # 4.0: every token chose expert 0
    # Explicit load (as a distributed caller passes after an all-reduce): bias moves by the sign.
    layer.router.expert_bias.zero_()
    layer.router.update_bias(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1] + [0.1] * 6 + [-0.1])


def test_eval_uses_eval_capacity_factor_and_no_noise():
    layer = make_layer(router="gshard", jitter_eps=0.2, eval_capacity_factor=0.5, capacity_factor=1.5)
    layer.eval()
    stats, _ = check_against_oracle(layer, tokens(), training=False)
    assert stats.capacity == expert_capacity(S * B, E, 2, 0.5, 1) == 4
    first, _ = layer(tokens())
    again, _ = layer(tokens())
    assert torch.equal(first, again)
    layer.train()
    layer(tokens())
    assert layer.last_stats.capacity == math.ceil(1.5 * 2 * S * B / E)


def test_router_generator_supplies_the_noise():
    layer = make_layer(router="gshard", jitter_eps=0.1)
    gen = layer.router.generator(torch.device("cpu"))
    state = gen.get_state()
    out, _ = layer(tokens())
    gen.set_state(state)
    noise = layer.router.draw_noise(S * B, H)
    assert isinstance(noise, RouterNoise) and noise.jitter_TH is not None and noise.uniform_T is not None
    replay, _ = layer(tokens(), noise=noise)
    assert torch.equal(out, replay)


def test_oracle_token_groups_have_their_own_capacity():
    layer = make_layer(router="switch")
    x = tokens().reshape(-1, H)
    params = dict(layer.named_parameters())
    whole = reference_moe(x, params, layer.config, training=True)
    halves = reference_moe(x, params, layer.config, training=True, group_sizes=[16, 16])
    assert whole.capacities == [4] and halves.capacities == [2, 2]
    first = reference_moe(x[:16], params, layer.config, training=True)
    torch.testing.assert_close(halves.out[:16], first.out)
    torch.testing.assert_close(halves.group_balance_losses[0], first.balance_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_loop_with_empty_experts(dtype):
    counts_L = torch.tensor([5, 0, 7, 0, 3, 1, 0, 4])
    x = torch.randn(int(counts_L.sum()), H, dtype=dtype)
    results = {}
    for backend in ("grouped_mm", "bmm", "loop"):
        experts = GroupedExperts(E, H, F, "swiglu", backend=backend).to(dtype)
        xb = x.clone().requires_grad_(True)
        experts(xb, counts_L).sum().backward()      # an expanded gradient: grouped_mm needs it contiguous
        results[backend] = (xb.grad, experts.weight1.grad, experts.weight2.grad)
    for backend in ("grouped_mm", "bmm"):
        for a, b in zip(results[backend], results["loop"]):
            torch.testing.assert_close(a, b, **(TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    assert results["loop"][1][1].abs().max() == 0
    experts = GroupedExperts(E, H, F)
    assert experts.pick_backend(x) == "grouped_mm"
    assert GroupedExperts(E, 6, F).pick_backend(torch.zeros(1, 6)) == "loop"   # 24-byte rows: unaligned


def test_expert_init_independent_of_ep_size_and_zero_contract():
    whole = GroupedExperts(E, H, F, seed=5)
    parts = [GroupedExperts(E, H, F, seed=5, ep_size=4, ep_rank=r, group_name="ep_size_4") for r in range(4)]
    assert torch.equal(torch.cat([p.weight1 for p in parts]), whole.weight1)
    assert torch.equal(torch.cat([p.weight2 for p in parts]), whole.weight2)
    assert all(p.allreduce is False and p.group_name == "ep_size_4" for part in parts for p in part.parameters())
    layer = make_layer()
    assert {"router.weight", "router.expert_bias", "experts.weight1", "experts.weight2"} <= set(layer.state_dict())
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in layer.experts.parameters())
    assert not hasattr(layer.router.weight, "allreduce")


def test_expert_grad_storage_reused_only_when_free(monkeypatch):
    """A large expert gradient's storage serves the next backward once nothing holds it; a held
    gradient (accumulation, a kept reference) is never written to, and every gradient is right."""
    from moe_plugin.layers import ffn_autograd

    monkeypatch.setattr(ffn_autograd, "REUSE_MIN_BYTES", 0)        # every size is "large" here
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16, seed=1)
    x_RH, counts_L = torch.randn(12, 8), torch.tensor([3, 0, 5, 4])
    dy_RH = torch.randn(12, 8)

    def backward() -> None:
        experts(x_RH, counts_L).backward(dy_RH)

    def ptr(grad: torch.Tensor) -> int:
        return grad.untyped_storage().data_ptr()

    backward()
    want = {n: p.grad.clone() for n, p in experts.named_parameters()}
    first = {n: ptr(p.grad) for n, p in experts.named_parameters()}
    experts.zero_grad(set_to_none=True)
    backward()                                                     # free again: same storage
    assert {n: ptr(p.grad) for n, p in experts.named_parameters()} == first
    backward()                                                     # .grad holds it: accumulate elsewhere
    for n, p in experts.named_parameters():
        torch.testing.assert_close(p.grad, 2 * want[n])
    kept = experts.weight1.grad
    experts.zero_grad(set_to_none=True)
    backward()                                                     # a reference outlives .grad
    torch.testing.assert_close(kept, 2 * want["weight1"])
    assert ptr(experts.weight1.grad) != ptr(kept)
    torch.testing.assert_close(experts.weight1.grad, want["weight1"])


def test_padded_exchange_refuses_a_header_the_hidden_size_cannot_hold():
    """Forced ``exchange`` padded: bf16 counts of capacity 70,000 take 3 base-256 digits, 4 local
    experts' header needs 13 values, more than H = 8: a ConfigError before anything is sent."""
    from moe_plugin.configs import ConfigError
    from moe_plugin.layers import Dispatcher, LayerParallelism, PaddedWire

    parallel = LayerParallelism(ep=object(), ep_size=2)
    dispatcher = Dispatcher(PaddedWire(parallel, 4, forced=True))
    plan = route(torch.randn(6, 8), kind="topk", k=2, normalize=True, capacity=70_000, deferred=True)
    with pytest.raises(ConfigError, match=r"moe.exchange: got 'padded'; its header row needs 13 values .* the "
                                          r"hidden size is 8; use 'counts' or 'auto'"):
        dispatcher.prepare(torch.randn(6, 8, dtype=torch.bfloat16), plan)


@pytest.mark.parametrize("kind", [dict(kind="gshard", k=2), dict(kind="topk", k=3, score="sigmoid"),
                                  dict(kind="topk", k=2, drop_policy="probability")])
def test_route_of_own_tokens_is_the_whole_routing_cut_to_them(kind):
    """``route(own=(first, n))`` (a TP rank's share of the micro-batch): the routing of all T tokens
    as one group (capacity, priority, losses), its plan cut to tokens first .. first + n - 1, in the
    same order, with ids among those tokens; the shares' counts add up to the whole's."""
    gen = torch.Generator().manual_seed(5)
    T, E, shares = 12, 4, 3
    n = T // shares
    logits_TE = torch.randn(T, E, generator=gen)
    logits_TE[:, 0] += 1.0                                        # crowd expert 0: capacity drops routes
    uniform_T = torch.rand(T, generator=gen) if kind["kind"] == "gshard" else None
    args = dict(normalize=True, capacity=3, uniform_T=uniform_T, slot_E=torch.tensor([2, 0, 3, 1]), **kind)
    whole = route(logits_TE, **args)
    assert whole.kept_E.sum() < whole.routed_E.sum()
    kept, routed = torch.zeros(E, dtype=torch.long), torch.zeros(E, dtype=torch.long)
    for s in range(shares):
        part = route(logits_TE, own=(s * n, n), **args)
        mine = (whole.token_R >= s * n) & (whole.token_R < (s + 1) * n)
        expected = whole.route_R[mine]
        assert part.num_tokens == n and part.capacity == whole.capacity
        assert torch.equal((part.route_R // n) * T + part.route_R % n + s * n, expected)
        assert torch.equal(part.token_R, whole.token_R[mine] - s * n)
        assert torch.equal(part.gate_R, whole.gate_R[mine])
        assert torch.equal(part.balance_loss, whole.balance_loss) and torch.equal(part.z_loss, whole.z_loss)
        assert torch.equal(part.slot_R(), whole.slot_R()[mine])
        kept += part.kept_E
        routed += part.routed_E
    assert torch.equal(kept, whole.kept_E) and torch.equal(routed, whole.routed_E)
