"""Sigmoid scores (DeepSeek-V3), gate_scale and drop_policy, beyond the oracle sweep of
``test_layers_single.py`` (whose ROUTERS hold their oracle cases): hand-worked routings, the
sigmoid balance loss by its definition, that the bias acts on scores, not on logits, and group-limited
routing against a brute-force choice."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_plugin.layers import route
from moe_plugin.layers.router import choose
from tests.unit.layers.test_layers_single import E, H, check_against_oracle, make_layer, tokens

SIGMOID = dict(router="topk", top_k=2, score_function="sigmoid")


def test_probability_policy_keeps_the_highest_scores_ties_by_route_id():
    # Top-1, every token to expert 0 with probabilities rising 1 < 3 = 3 > 2 (route id = token).
    logits_TE = torch.tensor([[1.0, 0.0], [3.0, 0.0], [3.0, 0.0], [2.0, 0.0]])
    position = route(logits_TE, kind="topk", k=1, normalize=False, capacity=2)
    assert position.route_R.tolist() == [0, 1]
    probability = route(logits_TE, kind="topk", k=1, normalize=False, capacity=2, drop_policy="probability")
    assert probability.route_R.tolist() == [1, 2]
    assert probability.kept_E.tolist() == [2, 0] and probability.routed_E.tolist() == [4, 0]
    one = route(logits_TE, kind="topk", k=1, normalize=False, capacity=1, drop_policy="probability")
    assert one.route_R.tolist() == [1]                  # the tie at 3: the lower route id
    # Top-2: token 2's second choice of expert 0 (p 0.475) beats token 0's (p 0.12); token 1's first
    # choice (p 0.62) stays. Position order would keep routes 1 and 3 (token 0's second choice).
    logits_TE = torch.tensor([[0.0, 2.0], [0.5, 0.0], [0.0, 0.1]])
    kept = lambda policy: route(logits_TE, kind="topk", k=2, normalize=True, capacity=2, drop_policy=policy)
    assert kept("position").route_R.tolist() == [1, 3, 0, 2]
    assert kept("probability").route_R.tolist() == [1, 5, 0, 2]


def test_drop_policy_is_moot_without_capacity():
    logits_TE = torch.randn(16, E, generator=torch.Generator().manual_seed(2))
    plans = [route(logits_TE, kind="topk", k=2, normalize=True, capacity=None, drop_policy=p)
             for p in ("position", "probability")]
    assert torch.equal(plans[0].route_R, plans[1].route_R) and torch.equal(plans[0].gate_R, plans[1].gate_R)


def test_sigmoid_balance_loss_by_its_definition():
    # E/k * sum_e f_e * P_e: token 0 ties (expert 0), token 1 prefers expert 0, so f = [1, 0].
    logits_TE = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    plan = route(logits_TE, kind="topk", k=1, normalize=False, capacity=None, score="sigmoid")
    s = 1 / (1 + math.exp(-2.0))
    assert float(plan.balance_loss) == pytest.approx(2 * (0.5 + s / (s + 0.5)) / 2, rel=1e-6)
    assert plan.gate_R.tolist() == pytest.approx([0.5, s])            # raw scores, not renormalised
    # Equal scores: P is uniform, so the loss is exactly 1 whatever the choices.
    layer = make_layer(**SIGMOID)
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(tokens())
    assert float(layer.last_stats.balance_loss) == 1.0


def test_gate_scale_multiplies_the_routed_output_only():
    outs, stats = {}, {}
    for scale in (1.0, 2.5):
        layer = make_layer(drop_tokens=False, gate_scale=scale, **SIGMOID)
        outs[scale], _ = layer(tokens())
        stats[scale] = layer.last_stats
    torch.testing.assert_close(outs[2.5], 2.5 * outs[1.0], atol=1e-5, rtol=1e-5)
    assert torch.equal(stats[2.5].routed_per_expert, stats[1.0].routed_per_expert)
    assert torch.equal(stats[2.5].balance_loss, stats[1.0].balance_loss)


@pytest.mark.parametrize("drop", [True, False], ids=["dropping", "dropless"])
def test_sigmoid_choice_adds_the_bias_to_scores_not_logits(drop):
    layer = make_layer(drop_tokens=drop, **SIGMOID)
    bias_E = torch.randn(E, generator=torch.Generator().manual_seed(4)) * 0.2
    layer.router.expert_bias.copy_(bias_E)
    logits_TE = layer.router.logits(tokens().reshape(-1, H))
    by_scores = (torch.sigmoid(logits_TE) + bias_E).topk(2).indices.sort().values
    by_logits = (logits_TE + bias_E).topk(2).indices.sort().values
    assert not torch.equal(by_scores, by_logits), "the case should tell the two choices apart"
    check_against_oracle(layer, tokens())


def _brute_force_group_choice(choice_TE, group_TE, G, M, k, per_group=2):
    """Per token: the M-subset of groups with the largest sum of group scores (each the sum of
    the group's ``per_group`` best ``group_TE`` values, sorted by hand), then the k best experts in it."""
    E = choice_TE.shape[1]
    n = E // G
    experts = []
    for choice, weight in zip(choice_TE.tolist(), group_TE.tolist()):
        score = [sum(sorted(weight[g * n:(g + 1) * n])[::-1][:per_group]) for g in range(G)]
        best = max(itertools.combinations(range(G), M), key=lambda groups: sum(score[g] for g in groups))
        allowed = [e for e in range(E) if e // n in best]
        experts.append(sorted(sorted(allowed, key=lambda e: -choice[e])[:k]))
    return experts


@pytest.mark.parametrize("per_group", [2, 1], ids=["top2_sum", "max"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("G, M, k", [(4, 1, 2), (4, 2, 3), (2, 1, 4), (8, 3, 3)])
def test_group_limit_keeps_each_token_inside_m_groups(score, G, M, k, per_group):
    logits_TE = torch.randn(64, E, generator=torch.Generator().manual_seed(G * 10 + M))
    bias_E = torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.3
    expert_TK, _, scores_TE = choose(logits_TE, score=score, k=k, normalize=True, expert_bias_E=bias_E,
                                     group_limit=(G, M, per_group))
    groups_used = [len(set(row)) for row in (expert_TK // (E // G)).tolist()]
    assert max(groups_used) <= M
    choice_TE = (logits_TE if score == "softmax" else scores_TE) + bias_E
    group_TE = torch.softmax(choice_TE, -1) if score == "softmax" else choice_TE
    assert expert_TK.sort(1).values.tolist() == _brute_force_group_choice(choice_TE, group_TE, G, M, k, per_group)
    free_TK = choose(logits_TE, score=score, k=k, normalize=True, expert_bias_E=bias_E)[0]
    # groups of one expert: the best M >= k groups hold the k best experts, so nothing changes
    assert torch.equal(free_TK, expert_TK) == (G == E), "the limit should bind unless groups are single experts"


GROUPED = dict(router="topk", top_k=2, router_groups=4, group_topk=1, score_function="sigmoid")


@pytest.mark.parametrize("drop", [True, False], ids=["dropping", "dropless"])
def test_group_limit_ranks_groups_on_score_plus_bias(drop):
    routed = []
    for bias in ([0.0] * E, [0.0, 0.0, 0.3, 0.3, 0.0, 0.0, -0.2, 0.0]):
        layer = make_layer(drop_tokens=drop, **GROUPED)
        layer.router.expert_bias.copy_(torch.tensor(bias))
        routed.append(check_against_oracle(layer, tokens())[0].routed_per_expert)
    unbiased, biased = routed
    assert biased[2:4].sum() > unbiased[2:4].sum()           # group 1 wins more tokens with the bias
    for routed in (biased, unbiased):   # k = 2 in one group of 2: every token's routes go to a whole group
        assert routed.view(4, 2)[:, 0].tolist() == routed.view(4, 2)[:, 1].tolist()


def test_group_score_max_ranks_groups_by_their_best_expert_as_the_oracle_does():
    """DeepSeek-V2's group_limited_greedy: softmax scores, a group ranked by its best probability, the
    gates unnormalised and scaled. The layer routes as the oracle; the two group scores choose differently."""
    fields = dict(router="topk", top_k=2, router_groups=4, group_topk=2, score_function="softmax",
                  normalize_gates=False, gate_scale=1.5)
    routed = {}
    for group_score in ("max", "top2_sum"):
        layer = make_layer(drop_tokens=False, group_score=group_score, **fields)
        routed[group_score] = check_against_oracle(layer, tokens())[0].routed_per_expert
    assert not torch.equal(routed["max"], routed["top2_sum"]), "the case should tell the two group scores apart"
