"""Router: which experts each token goes to, with what gate weight, and which routes fit. ``route`` is
a pure function of the fp32 logits and explicitly passed random numbers, so an oracle can replay it.
No host sync: the plan lists every route, the kept ones first, by slot, with a pending finite check.
Shape suffixes: see ``moe_plugin.layers``; the rules: docs/design/layers_router.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_plugin.configs.capacity import exact_factor, expert_capacity
from moe_plugin.configs.schema import MoEConfig
from moe_plugin.layers import comm
from moe_plugin.layers.init import seeded_generator

ROUTER_STREAM = 1  # seed stream of the router weight (see init.py)
NOISE_STREAM = 4   # seed stream of the router's noise; index: the rank's DP replica


@dataclass(frozen=True)
class RouterNoise:
    """The random numbers of one training forward, drawn in this order (None: not drawn)."""

    jitter_TH: Optional[Tensor] = None   # multiplicative U(1 - eps, 1 + eps) on the router input
    uniform_T: Optional[Tensor] = None   # U(0, 1) for GShard's random routing of the 2nd expert


@dataclass(frozen=True)
class RoutingPlan:
    """One batch's routing, built by argsort: route ``(choice j, token t)`` has id ``j * T + t``; kept
    routes listed by expert slot, then in the drop policy's order (docs/design/layers_router.md)."""

    num_tokens: int
    k: int
    route_R: Tensor                       # route id of each kept route
    token_R: Tensor                       # its token (route_R % T)
    gate_R: Tensor                        # its gate weight (fp32, differentiable)
    kept_E: Tensor                        # kept routes per expert (expert id order)
    routed_E: Tensor                      # routes per expert before capacity (after random routing): the load
    capacity: Optional[int]               # on the host; None when dropless or while capacity_1 is unread
    balance_loss: Tensor                  # fp32 scalars, unweighted, differentiable
    z_loss: Tensor
    kept_D: Tensor                        # kept routes per slot (dispatch order)
    capacity_1: Optional[Tensor] = None   # [1] the real tokens' capacity on the device, until the host sync
    block_capacity: Optional[int] = None  # the capacity of all T tokens, padding included (padded blocks)

    @property
    def num_experts(self) -> int:
        return self.kept_E.numel()

    def kept(self, num_kept: int, capacity: Optional[int] = None) -> "RoutingPlan":
        """This plan's first ``num_kept`` routes: the kept ones, given ``kept_D.sum()`` as read on the host
        (and ``capacity``, ``capacity_1`` read at the same sync)."""
        plan = self if capacity is None else replace(self, capacity=capacity, capacity_1=None)
        if plan.route_R.numel() == num_kept:
            return plan
        return replace(plan, route_R=plan.route_R[:num_kept], token_R=plan.token_R[:num_kept],
                       gate_R=plan.gate_R[:num_kept])

    def slot_R(self) -> Tensor:
        """The slot of each listed route, once the plan lists its kept routes only (``kept``)."""
        slots_D = torch.arange(self.kept_D.numel(), device=self.kept_D.device)
        return torch.repeat_interleave(slots_D, self.kept_D, output_size=self.route_R.numel())

    @property
    def dropped_fraction(self) -> Tensor:
        """Fraction of routes (after random routing) dropped by capacity."""
        routed = self.routed_E.sum()
        return (routed - self.kept_E.sum()).float() / routed.clamp(min=1).float()


class FiniteCheck:
    """The finite check of one forward's logits, agreed over ``group`` without blocking and read at the
    caller's host sync (``flags``, ``verdict``): every rank raises together. ``bad_1``: this rank's flag."""

    def __init__(self, logits_TE: Tensor, group: comm.Group = None):
        self.bad_1 = (~torch.isfinite(logits_TE).all()).reshape(1).to(torch.int32)
        self.group = group
        self._work = None
        if group is None:
            self._flags = self.bad_1
        else:
            n = comm.group_size(group)
            self._flags = torch.empty(n, dtype=torch.int32, device=logits_TE.device)
            self._work = torch.distributed.all_to_all_single(self._flags, self.bad_1.expand(n).contiguous(),
                                                            group=group, async_op=True)

    def flags(self) -> Tensor:
        """[group size] int32 on the logits' device (waits for the exchange; no host sync)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._flags

    @staticmethod
    def verdict(flags: list[int], group: comm.Group = None) -> None:
        """Raise if any flag is set; ``flags[i]`` belongs to rank i of ``group``."""
        if not any(flags):
            return
        where = ""
        if group is not None:
            ranks = torch.distributed.get_process_group_ranks(group)
            where = f" on rank(s) {[rank for rank, flag in zip(ranks, flags) if flag]}"
        raise ValueError(f"MoE router logits are not finite{where}: the MoE layer input (hidden states) "
                         "contains NaN or inf (or the router weight does)")


def top_k_experts(choice_TE: Tensor, k: int) -> Tensor:
    """The k largest of each row, largest first, equal values lower index first (a stable descending
    sort's order; ``torch.topk`` promises nothing about ties): k rounds of ``argmax``."""
    picks, work_TE = [], choice_TE
    for j in range(k):
        picks.append(work_TE.argmax(-1, keepdim=True))
        if j + 1 < k:
            work_TE = (work_TE.clone() if j == 0 else work_TE).scatter_(1, picks[-1], float("-inf"))
    return torch.cat(picks, 1)


def stable_partition(index_X: Tensor, first_X: Tensor) -> Tensor:
    """``index_X`` with its entries where ``first_X`` moved to the front, both parts in order; no host sync."""
    before_X = torch.cumsum(first_X, 0)          # entries that go first, up to and including each
    i_X = torch.arange(index_X.numel(), device=index_X.device)
    dest_X = torch.where(first_X, before_X - 1, before_X[-1:] + i_X - before_X)
    return torch.empty_like(index_X).index_copy_(0, dest_X, index_X)


def count_values(index_X: Tensor, n: int) -> Tensor:
    """``torch.bincount(index_X, minlength=n)`` for values below ``n``, without bincount's host sync on CUDA."""
    return torch.zeros(n, dtype=torch.long, device=index_X.device).index_add_(0, index_X, torch.ones_like(index_X))


def limit_to_groups(choice_TE: Tensor, groups: int, m: int, per_group: int = 2,
                    group_score_TE: Optional[Tensor] = None) -> Tensor:
    """``choice_TE`` with -inf for every expert outside each token's best ``m`` of ``groups`` groups of
    consecutive ids, a group scored by the sum of its ``per_group`` largest ``group_score_TE`` values."""
    T, E = choice_TE.shape
    group_score_TGN = (choice_TE if group_score_TE is None else group_score_TE).reshape(T, groups, E // groups)
    score_TG = group_score_TGN.topk(min(per_group, E // groups), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(score_TG, dtype=torch.bool).scatter_(1, top_k_experts(score_TG, m), True)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, groups, E // groups).reshape(T, E)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


def choose(logits_TE: Tensor, *, score: str, k: int, normalize: bool, expert_bias_E: Optional[Tensor] = None,
           group_limit: Optional[tuple[int, ...]] = None,
           bias_on: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(expert_TK, gate_TK, scores_TE)``: each token's k experts, their gates (unbiased scores) and every
    expert's score; the bias joins the logits (softmax) or the scores (sigmoid, ``bias_on`` "scores")."""
    scores_TE = F.softmax(logits_TE, dim=-1) if score == "softmax" else torch.sigmoid(logits_TE)
    on_logits = score == "softmax" and bias_on != "scores"
    choice_TE = (logits_TE if on_logits else scores_TE).detach()
    if expert_bias_E is not None:
        choice_TE = choice_TE + expert_bias_E.to(choice_TE)
    if group_limit is not None:
        group_score_TE = F.softmax(choice_TE, dim=-1) if on_logits else None
        choice_TE = limit_to_groups(choice_TE, *group_limit, group_score_TE=group_score_TE)
    expert_TK = top_k_experts(choice_TE, k)
    gate_TK = scores_TE.gather(1, expert_TK)
    if normalize:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)
    return expert_TK, gate_TK, scores_TE


def priority_order(key_R: Tensor, score_R: Optional[Tensor]) -> Tensor:
    """Routes sorted by ``key_R`` (slot), within a key by route id or, given ``score_R``, by score."""
    if score_R is None:
        return torch.argsort(key_R, stable=True)
    by_score_R = torch.argsort(score_R, descending=True, stable=True)
    return by_score_R[torch.argsort(key_R[by_score_R], stable=True)]


def balance_terms(score: str, expert_TK: Tensor, scores_TE: Tensor) -> tuple[Tensor, Tensor]:
    """``(counted_TX, share_TE)``: what the balance loss counts and averages (softmax: first choices
    and probabilities; sigmoid: all k choices and each token's score shares)."""
    if score == "softmax":
        return expert_TK[:, :1], scores_TE
    return expert_TK, scores_TE / scores_TE.sum(dim=-1, keepdim=True)


def real_terms(counted_TX: Tensor, share_TE: Tensor, real_T: Tensor) -> tuple[Tensor, Tensor]:
    """``balance_terms`` with padding taken out: its choices counted in a bucket E, its shares 0."""
    E = share_TE.shape[1]
    return torch.where(real_T[:, None], counted_TX, E), torch.where(real_T[:, None], share_TE, 0.0)


def balance_loss(score: str, expert_TK: Tensor, scores_TE: Tensor, real_T: Optional[Tensor] = None) -> Tensor:
    """``E * sum_e f_e * P_e`` over this batch's real tokens (micro_batch scope; the others: ``balance.py``)."""
    counted_TX, share_TE = balance_terms(score, expert_TK, scores_TE)
    T, E = share_TE.shape
    if real_T is None:
        f_E = count_values(counted_TX.reshape(-1), E).float() / max(counted_TX.numel(), 1)
        return E * (f_E * (share_TE.sum(0) / max(T, 1))).sum()
    counted_TX, share_TE = real_terms(counted_TX, share_TE, real_T)
    n = real_T.sum()
    f_E = count_values(counted_TX.reshape(-1), E + 1)[:E].float() / (n * counted_TX.shape[1]).clamp(min=1)
    return E * (f_E * (share_TE.sum(0) / n.clamp(min=1))).sum()


def capacity_of(count_1: Tensor, num_experts: int, k: int, capacity_factor, min_capacity: int) -> Tensor:
    """``expert_capacity`` of a token count on the device ([1]; no host sync), exactly."""
    factor = exact_factor(capacity_factor)
    num, den = factor.numerator * int(k), factor.denominator * int(num_experts)
    return ((count_1.long() * num + (den - 1)) // den).clamp(min=int(min_capacity))


def route(logits_TE: Tensor, *, kind: str, k: int, normalize: bool, capacity: Optional[int],
          expert_bias_E: Optional[Tensor] = None, uniform_T: Optional[Tensor] = None,
          slot_E: Optional[Tensor] = None, deferred: bool = False, score: str = "softmax",
          scale: float = 1.0, drop_policy: str = "position", balance=balance_loss,
          group_limit: Optional[tuple[int, ...]] = None, own: Optional[tuple[int, int]] = None,
          real_T: Optional[Tensor] = None, real_capacity_1: Optional[Tensor] = None,
          bias_on: Optional[str] = None) -> RoutingPlan:
    """The routing plan for fp32 ``logits_TE``. ``deferred``: the caller checks the logits and cuts the
    plan at its host sync; ``own`` ``(first, n)``: all T tokens one GShard group, the plan that of tokens
    ``first ..`` (TP); ``real_T`` false on padding. The options: docs/design/layers_router.md."""
    T, E = logits_TE.shape
    expert_TK, gate_TK, scores_TE = choose(logits_TE, score=score, k=k, normalize=normalize or kind == "gshard",
                                           expert_bias_E=expert_bias_E, group_limit=group_limit, bias_on=bias_on)
    valid_TK = torch.ones_like(expert_TK, dtype=torch.bool)
    if uniform_T is not None:
        if kind != "gshard":
            raise ValueError(f"random routing is GShard's; router kind is {kind!r}")
        valid_TK[:, 1] = 2 * gate_TK[:, 1].detach() > uniform_T.to(gate_TK)
    if real_T is not None:
        valid_TK &= real_T[:, None]

    # Priority order (drop policy): route id j*T + t. Invalid routes sort last under the sentinel key E.
    slot_TK = expert_TK if slot_E is None else slot_E[expert_TK]
    key_R = torch.where(valid_TK.t().reshape(-1), slot_TK.t().reshape(-1), E)
    by_score = capacity is not None and drop_policy == "probability"
    order_R = priority_order(key_R, scores_TE.detach().gather(1, expert_TK).t().reshape(-1) if by_score else None)
    key_sorted_R = key_R[order_R]
    count_D1 = count_values(key_R, E + 1)
    routed_D = count_D1[:E]
    keep_sorted_R = key_sorted_R < E
    if capacity is not None:
        limit = capacity if real_capacity_1 is None else real_capacity_1
        start_D1 = torch.cumsum(count_D1, 0) - count_D1
        position_R = torch.arange(key_R.numel(), device=key_R.device) - start_D1[key_sorted_R]
        keep_sorted_R &= position_R < limit
        kept_D = routed_D.clamp(max=limit)
    else:
        kept_D = routed_D
    if own is None:
        n, full_R = T, None
        route_R = stable_partition(order_R, keep_sorted_R)     # every route, the kept ones first
    else:                                                      # only my tokens' routes, in that order
        first, n = own
        mine_sorted_R = (order_R % T >= first) & (order_R % T < first + n)
        routed_D = count_values(torch.where(mine_sorted_R, key_sorted_R, E), E + 1)[:E]
        kept_D = count_values(torch.where(mine_sorted_R & keep_sorted_R, key_sorted_R, E), E + 1)[:E]
        keep_mine_R = stable_partition(keep_sorted_R, mine_sorted_R)[:k * n]
        full_R = stable_partition(stable_partition(order_R, mine_sorted_R)[:k * n], keep_mine_R)
        route_R = (full_R // T) * n + full_R % T - first      # ids among my n tokens
    routed_E, kept_E = (routed_D, kept_D) if slot_E is None else (routed_D[slot_E], kept_D[slot_E])

    if scale != 1.0:
        gate_TK = gate_TK * scale
    z_T = torch.logsumexp(logits_TE, dim=-1).square()
    if real_T is None:
        z_loss = z_T.sum() / max(T, 1)
    else:
        z_loss = torch.where(real_T, z_T, 0.0).sum() / real_T.sum().clamp(min=1)
    pending = capacity is not None and real_capacity_1 is not None
    plan = RoutingPlan(num_tokens=n, k=k, route_R=route_R, token_R=route_R % max(n, 1),
                       gate_R=gate_TK.t().reshape(-1)[route_R if full_R is None else full_R], kept_E=kept_E,
                       routed_E=routed_E, capacity=None if pending else capacity,
                       balance_loss=balance(score, expert_TK, scores_TE), z_loss=z_loss, kept_D=kept_D,
                       capacity_1=real_capacity_1 if pending else None, block_capacity=capacity)
    if deferred:
        return plan
    read = [FiniteCheck(logits_TE).bad_1.long(), kept_D.sum().reshape(1)] + ([plan.capacity_1] if pending else [])
    bad, num_kept, *read_capacity = torch.cat(read).tolist()
    FiniteCheck.verdict([bad])
    return plan.kept(num_kept, read_capacity[0] if pending else None)


class Router(nn.Module):
    """The gate of one MoE layer: ``forward(x_TH, noise=None) -> (RoutingPlan, FiniteCheck)``; the groups:
    gradient sum (``grad_group``), finite check (``check_group``), the micro-batch's shares (``share_group``)."""

    def __init__(self, config: MoEConfig, hidden_size: int, *, seed: int = 0, init_std: float = 0.02,
                 noise_index: int = 0, grad_group: comm.Group = None, check_group: comm.Group = None,
                 share_group: comm.Group = None):
        super().__init__()
        self.config, self.seed, self.noise_index = config, seed, noise_index
        self.share_group, self.grad_group, self.check_group = share_group, grad_group, check_group
        E = config.num_experts
        gen = seeded_generator(seed, ROUTER_STREAM)
        self.weight = nn.Parameter(torch.randn(E, hidden_size, generator=gen) * init_std)
        self.register_buffer("expert_bias", torch.zeros(E))
        # router_logit_bias (GPT-OSS): zeros, summed over grad_group like the weight
        self.bias = nn.Parameter(torch.zeros(E)) if config.router_logit_bias else None
        self.register_buffer("load_E", torch.zeros(E), persistent=False)   # since the last bias update (update_bias)
        self._generators: dict[torch.device, torch.Generator] = {}

    def capacity(self, num_tokens: int | Tensor) -> Optional[int | Tensor]:
        """Per-expert capacity for ``num_tokens`` tokens in the current mode (a device count: on the device)."""
        if not self.config.drop_tokens:
            return None
        c = self.config
        factor = c.capacity_factor if self.training else c.eval_capacity_factor
        if isinstance(num_tokens, Tensor):
            return capacity_of(num_tokens, c.num_experts, c.k, factor, c.min_capacity)
        return expert_capacity(num_tokens, c.num_experts, c.k, factor, c.min_capacity)

    def generator(self, device: torch.device) -> torch.Generator:
        """This router's generator on ``device``, created on first use from ``seed``."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = seeded_generator(self.seed, NOISE_STREAM, self.noise_index, device=device)
        return self._generators[device]

    def draw_noise(self, num_tokens: int, hidden_size: int, device: torch.device = torch.device("cpu")) -> RouterNoise:
        """The random numbers one training forward uses (nothing when jitter and random routing are off)."""
        gen = self.generator(device)
        jitter = uniform = None
        eps = self.config.jitter_eps
        if eps > 0:
            jitter = torch.rand(num_tokens, hidden_size, generator=gen, device=device) * (2 * eps) + (1 - eps)
        if self.config.router == "gshard" and self.config.second_expert_policy == "random":
            uniform = torch.rand(num_tokens, generator=gen, device=device)
        return RouterNoise(jitter_TH=jitter, uniform_T=uniform)

    def logits(self, x_TH: Tensor, noise: Optional[RouterNoise] = None) -> Tensor:
        """fp32 logits [T, E]; jitter applies to the router input only."""
        x_TH = x_TH.float()
        if noise is not None and noise.jitter_TH is not None:
            x_TH = x_TH * noise.jitter_TH
        logits_TE = x_TH @ comm.all_reduce_grad(self.weight.float(), self.grad_group).t()
        if self.bias is not None:
            logits_TE = logits_TE + comm.all_reduce_grad(self.bias.float(), self.grad_group)
        return logits_TE

    def forward(self, x_TH: Tensor, noise: Optional[RouterNoise] = None, slot_E: Optional[Tensor] = None,
                balance=balance_loss, real_T: Optional[Tensor] = None) -> tuple[RoutingPlan, FiniteCheck]:
        """Route ``x_TH`` (this rank's share); ``noise`` for the whole micro-batch, drawn in training by
        default; ``real_T``: its real tokens. The caller calls ``record_load`` once the plan is checked."""
        n = x_TH.shape[0]
        shares, me = comm.group_size(self.share_group), comm.group_rank(self.share_group)
        T = n * shares                     # the micro-batch: my share and those of ``share_group``
        if self.training and noise is None:
            noise = self.draw_noise(T, x_TH.shape[1], x_TH.device)
        if not self.training:
            noise = None
        if noise is not None and noise.jitter_TH is not None and shares > 1:
            noise = replace(noise, jitter_TH=noise.jitter_TH[me * n:(me + 1) * n])
        logits_TE = self.logits(x_TH, noise)
        finite = FiniteCheck(logits_TE, self.check_group)
        own = None
        if shares > 1:                     # route the whole micro-batch, keep my tokens' routes
            logits_TE, own = comm.gather_tokens(logits_TE, self.share_group), (me * n, n)
        c = self.config
        capacity = self.capacity(T)
        real_capacity_1 = None if real_T is None or capacity is None else self.capacity(real_T.sum().reshape(1))
        return route(logits_TE, kind=c.router, k=c.k, normalize=c.router == "topk" and c.normalize_gates,
                     capacity=capacity, expert_bias_E=self.expert_bias,
                     uniform_T=noise.uniform_T if noise is not None else None, slot_E=slot_E,
                     deferred=True, score=c.score_function, scale=c.gate_scale, drop_policy=c.drop_policy,
                     balance=balance, group_limit=c.group_limit, own=own, real_T=real_T,
                     real_capacity_1=real_capacity_1, bias_on=c.expert_bias_on), finite

    @torch.no_grad()
    def record_load(self, plan: RoutingPlan) -> None:
        """Add a checked training plan's load to ``load_E`` (the aux-loss-free bias reads it)."""
        if self.training:
            self.load_E += plan.routed_E.to(self.load_E)

    @torch.no_grad()
    def update_bias(self, load_E: Optional[Tensor] = None) -> None:
        """Aux-loss-free balancing step ``bias += rate * sign(mean(load) - load)``, from ``load_E`` (default:
        the training forwards' load since the last call). After the optimizer step, never in forward."""
        if load_E is None:
            load_E = self.load_E
        load_E = load_E.to(self.expert_bias).float()
        self.expert_bias += self.config.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.load_E.zero_()
