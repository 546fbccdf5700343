"""aux_loss_scope on one rank: the sequence-wise loss against a plain per-sequence computation, the
global scope's gradient accumulation (micro-batch m counts micro-batches 1..m; reset per step),
and the micro-batch loss unchanged. Layouts: ``test_layers_dist.py`` (``_check_scope_case``)."""
from __future__ import annotations

import pytest
import torch

from moe_plugin.layers.router import balance_loss, count_values, top_k_experts
from tests.unit.layers.test_layers_single import E, H, make_layer, tokens

SCORES = {"softmax": dict(router="topk", top_k=2), "sigmoid": dict(router="topk", top_k=2, score_function="sigmoid")}
COEFF = 0.1


def _terms(layer, x_TH: torch.Tensor, score: str):
    """(counted choices per expert [E], share of each expert per token [T, E]), from the router
    weight by the definitions: softmax counts first choices of the probabilities, sigmoid all k
    choices of the scores, whose share is the score over the token's sum of scores."""
    logits_TE = x_TH @ layer.router.weight.t()
    if score == "softmax":
        share_TE = torch.softmax(logits_TE, -1)
        counted = torch.stack([row.argmax() for row in logits_TE.detach()])
    else:
        scores_TE = torch.sigmoid(logits_TE)
        share_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        counted = torch.cat([row.topk(2).indices for row in scores_TE.detach()])
    return torch.bincount(counted, minlength=E).float(), share_TE


def _aux_only(layer, x_SBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(balance loss, router-weight gradient of aux_loss_coeff times it) of one training forward."""
    layer.router.weight.grad = None
    out, _ = layer(x_SBH)
    (out * 0).sum().backward()          # only the attached aux loss reaches the router
    return layer.last_stats.balance_loss, layer.router.weight.grad.clone()


@pytest.mark.parametrize("score", list(SCORES))
def test_sequence_scope_is_the_mean_over_sequences(score):
    layer = make_layer(aux_loss_coeff=COEFF, aux_loss_scope="sequence", drop_tokens=False, **SCORES[score]).train()
    x_SBH = tokens(s=6, b=3)
    loss, grad = _aux_only(layer, x_SBH)
    w = layer.router.weight
    losses = []
    for b in range(x_SBH.shape[1]):     # sequence b: the tokens x[:, b]
        counts_E, share_TE = _terms(layer, x_SBH[:, b], score)
        f_E = counts_E / counts_E.sum()
        losses.append(E * (f_E * share_TE.mean(0)).sum())
    expected = torch.stack(losses).mean()
    expected_grad, = torch.autograd.grad(COEFF * expected, w)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-6)
    micro, _ = _aux_only(make_layer(aux_loss_coeff=COEFF, drop_tokens=False, **SCORES[score]).train(), x_SBH)
    assert not torch.allclose(micro, loss, atol=1e-4), "the case should tell the scopes apart"
    with pytest.raises(ValueError, match=r"aux_loss_scope 'sequence' needs the MoE layer input as \[S, B, H\]"):
        layer(x_SBH.reshape(-1, H))


@pytest.mark.parametrize("score", list(SCORES))
def test_global_scope_counts_the_micro_batches_of_the_step_so_far(score):
    layer = make_layer(aux_loss_coeff=COEFF, aux_loss_scope="global", drop_tokens=False, **SCORES[score]).train()
    xs = [tokens(seed=s) for s in (1, 2, 3)]
    terms = [_terms(layer, x.reshape(-1, H), score) for x in xs]

    def expected(counts_E, share_TE):
        loss = E * (counts_E / counts_E.sum() * share_TE.mean(0)).sum()
        return loss.detach(), torch.autograd.grad(COEFF * loss, layer.router.weight, retain_graph=True)[0]

    def check(actual, wanted):
        for a, w in zip(actual, wanted):
            torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-6)

    check(_aux_only(layer, xs[0]), expected(terms[0][0], terms[0][1]))                  # its own counts only
    layer.eval()
    layer(xs[2])                                                                      # adds nothing
    layer.train()
    check(_aux_only(layer, xs[1]), expected(terms[0][0] + terms[1][0], terms[1][1]))   # 1..2
    layer.reset_balance_counts()                                                      # the next step
    check(_aux_only(layer, xs[2]), expected(terms[2][0], terms[2][1]))
    # One micro-batch on one rank: the micro-batch loss itself.
    micro = make_layer(aux_loss_coeff=COEFF, drop_tokens=False, **SCORES[score]).train()
    layer.reset_balance_counts()
    check(_aux_only(layer, xs[0]), _aux_only(micro, xs[0]))


def test_micro_batch_scope_is_unchanged():
    """The default's loss, bit for bit as formed before aux_loss_scope: GShard's first-choice
    fraction over T, sigmoid's k * T routes over per-token score shares."""
    logits_TE = torch.randn(64, E, generator=torch.Generator().manual_seed(5))
    for score, k in (("softmax", 2), ("sigmoid", 3)):
        scores_TE = torch.softmax(logits_TE, -1) if score == "softmax" else torch.sigmoid(logits_TE)
        expert_TK = top_k_experts(logits_TE, k)
        if score == "softmax":
            f_E, share_TE = count_values(expert_TK[:, 0], E).float() / 64, scores_TE
        else:
            f_E = count_values(expert_TK.reshape(-1), E).float() / (64 * k)
            share_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        assert torch.equal(balance_loss(score, expert_TK, scores_TE), E * (f_E * (share_TE.sum(0) / 64)).sum())
    layers = [make_layer(aux_loss_coeff=COEFF, **scope).train() for scope in ({}, {"aux_loss_scope": "micro_batch"})]
    first, second = (_aux_only(layer, tokens()) for layer in layers)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
