"""Predicted time and memory of one training step of a GPT-MoE under one ``Layout``.

Per rank and pipeline stage: the slowest stage sets the pipeline's pace, the most loaded expert rank an
MoE layer's; nothing overlaps, a step is the sum of its parts. The MoE layer's collectives are those it
runs (``placement/costs.py``, shared with the runtime). A load profile is a route fraction per expert
(``load_ME``), a placement the slot of every expert; None: uniform load, static placement.
Formulas and their validation: docs/planner.md, *The cost model*.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from moe_plugin.configs.capacity import expert_capacity
from moe_plugin.placement.costs import computed_routes, exchanged_routes, moe_layer_collectives, replication_bytes
from moe_plugin.planner.spec import ClusterSpec, Layout, PlanModel

STEP_REDUCTIONS = 3   # small all-reduces of an engine step (grad norm of dense and expert groups, overflow)


@dataclass
class StepCost:
    """A step's predicted seconds by part and bytes per rank by kind (the largest stage)."""

    compute: float = 0.0          # dense GEMMs, router, LM head (slowest stage, whole step)
    experts: float = 0.0          # expert GEMMs on the most loaded rank
    dispatch: float = 0.0         # the MoE layers' routing, permutation and activation (non-GEMM work)
    all_to_all: float = 0.0
    tp_comm: float = 0.0          # TP all-reduces, ETP gathers, MoE token split/gather
    pp_comm: float = 0.0          # activations between stages
    dp_comm: float = 0.0          # gradient reduction (and ZeRO parameter gathers)
    optimizer: float = 0.0
    overhead: float = 0.0
    replication: float = 0.0      # shadowed experts' weight and gradient all-reduces over EP
    bubble: float = 0.0           # pipeline bubble share of the per-micro-batch parts
    memory: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.experts + self.dispatch + self.all_to_all + self.tp_comm + self.pp_comm
                + self.dp_comm + self.optimizer + self.overhead + self.replication)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    def as_dict(self) -> dict:
        out = asdict(self)
        if not self.replication:          # only a replay with shadowed experts has it
            del out["replication"]
        out["total"] = self.total
        out["memory_total"] = self.memory_total
        return out


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B (or GPipe) pipeline step: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def bubble_speed(cluster: ClusterSpec, pp: int) -> float:
    """A bubble slot's time relative to a full one: max(1/oversubscription, 1/pp) (1 on dedicated devices)."""
    return max(1.0 / cluster.oversubscription, 1.0 / pp) if pp > 1 else 1.0


def group_span(layout: Layout, dim: str, expert_grid: bool = False) -> int:
    """Consecutive ranks a group of ``dim`` spans: the product of the sizes laid out up to ``dim``."""
    sizes = ({"tp": layout.etp, "ep": layout.ep, "dp": layout.edp, "pp": layout.pp} if expert_grid
             else {"tp": layout.tp, "ep": 1, "dp": layout.dp, "pp": layout.pp})
    span = 1
    for token in layout.order.split("-"):
        span *= sizes.get(token, 1)
        if token == dim:
            return span
    raise ValueError(f"order {layout.order!r} has no {dim!r}")


def _collective(cluster: ClusterSpec, n: int, nbytes: float, span: int, kind: str) -> float:
    """Ring collectives over ``n`` ranks spanning ``span`` consecutive ranks: ``all_reduce`` moves 2 (n-1)/n of the
    bytes, ``gather``/``scatter`` (all-gather, reduce-scatter) (n-1)/n."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = cluster.ring_link(span)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * ((n - 1) / n * nbytes / bw + (n - 1) * lat)


def _peers_in_node(cluster: ClusterSpec, n: int, span: int) -> int:
    """Ranks of a group of ``n`` over ``span`` consecutive ranks that share a node with one of them."""
    return max(1, min(n, n * cluster.gpus_per_node // max(1, span)))


def _all_to_all(cluster: ClusterSpec, n: int, intra_P, inter_P, peers: int) -> float:
    """One all-to-all: the busiest rank's bytes in and across nodes at their bandwidths, plus a message per peer."""
    if n <= 1:
        return 0.0
    t = float(np.max(np.asarray(intra_P) / cluster.intra_bandwidth + np.asarray(inter_P) / cluster.inter_bandwidth))
    return t + (peers - 1) * cluster.intra_latency + (n - peers) * cluster.inter_latency


def _small_all_to_all(cluster: ClusterSpec, n: int, nbytes: float, span: int) -> float:
    """An all-to-all of ``nbytes`` to every peer (counts, flags): latency-bound."""
    peers = _peers_in_node(cluster, n, span)
    return _all_to_all(cluster, n, nbytes * (peers - 1), nbytes * (n - peers), peers)


def stage_layers(model: PlanModel, pp: int) -> list[list[int]]:
    """Global layer indices of each pipeline stage (even split; the search requires pp | layers)."""
    per = model.shape.num_layers // pp
    return [list(range(s * per, (s + 1) * per)) for s in range(pp)]


def expert_rows_by_expert(model: PlanModel, layout: Layout, load_E: Optional[np.ndarray]) -> np.ndarray:
    """[E] rows of each expert in one MoE layer and micro-batch (every EP and ETP sender together)."""
    moe, E, T = model.moe, model.moe.num_experts, layout.micro_batch * model.shape.seq_length
    routes = moe.k * T / layout.tp                             # per sender rank
    share = np.full(E, 1.0 / E) if load_E is None else np.asarray(load_E, dtype=float) / max(np.sum(load_E), 1e-30)
    kept = share * routes
    if moe.drop_tokens:   # the capacity of the replica's T tokens, shared by its TP senders
        capacity = expert_capacity(T, E, moe.k, moe.capacity_factor, moe.min_capacity)
        kept = np.minimum(kept, capacity / layout.tp)
    return layout.ep * layout.etp * kept


def expert_rows(model: PlanModel, layout: Layout, load_E: Optional[np.ndarray], placement_E=None,
                shadow_E=None) -> np.ndarray:
    """[ep] rows each EP rank's experts process in one MoE layer and micro-batch (shadowed experts' stay home)."""
    rows_E = expert_rows_by_expert(model, layout, load_E)
    if shadow_E is not None:
        rows_E = np.where(np.asarray(shadow_E, dtype=bool), 0.0, rows_E)
    per_rank = model.moe.num_experts // layout.ep
    slot_E = np.arange(model.moe.num_experts) if placement_E is None else np.asarray(placement_E)
    return np.bincount(slot_E // per_rank, weights=rows_E, minlength=layout.ep)


def ep_routes(model: PlanModel, layout: Layout, load_E, senders_PE=None) -> np.ndarray:
    """[ep, E] kept routes of one micro-batch from each EP rank to each expert (``senders_PE``: shares, None: 1/ep)."""
    rows_E = expert_rows_by_expert(model, layout, load_E) / layout.etp
    E = model.moe.num_experts
    share = np.full((layout.ep, E), 1.0 / layout.ep) if senders_PE is None else np.asarray(senders_PE, float)
    return share * rows_E


def _shadow_all_reduce(model: PlanModel, cluster: ClusterSpec, layout: Layout, shadowed: int) -> float:
    """One all-reduce over EP of ``shadowed`` experts' weights (or gradients) on the EP group's link."""
    P = layout.ep
    bw, lat = cluster.link(group_span(layout, "ep", expert_grid=True))
    expert_bytes = model.expert_params() / layout.etp * model.options.param_bytes
    return replication_bytes(P, shadowed, expert_bytes) / bw + 2 * (P - 1) * lat


def replication_time(model: PlanModel, cluster: ClusterSpec, layout: Layout, shadowed: int) -> float:
    """Seconds of one layer's shadowed experts per micro-batch: their weights' and gradients' all-reduces over EP."""
    return 0.0 if shadowed == 0 or layout.ep == 1 else 2 * _shadow_all_reduce(model, cluster, layout, shadowed)


def moe_comm_time(model: PlanModel, cluster: ClusterSpec, layout: Layout, routes_PE, rank_E, shadow_E,
                  exchanged: float) -> dict[str, float]:
    """Seconds of the collectives one MoE layer runs per micro-batch (``costs.moe_layer_collectives``, each priced
    here), by ``StepCost`` part. ``exchanged``: rows the busiest rank's experts receive."""
    H, b, E = model.shape.hidden_size, model.options.activation_bytes, model.moe.num_experts
    T = layout.micro_batch * model.shape.seq_length
    shadowed = int(np.count_nonzero(shadow_E)) if shadow_E is not None else 0
    ep_span, tp_span = group_span(layout, "ep", expert_grid=True), group_span(layout, "tp")
    peers = _peers_in_node(cluster, layout.ep, ep_span)
    intra, inter = exchanged_routes(routes_PE, rank_E, np.arange(layout.ep) // peers, shadow_E)
    etp_span = group_span(layout, "tp", expert_grid=True)
    price = {   # (group, what) -> (part, seconds)
        ("tokens", "finite flags"): ("all_to_all", _small_all_to_all(cluster, layout.tp * layout.dp, 4,
                                                                     group_span(layout, "dp"))),
        ("ep", "counts"): ("all_to_all", _small_all_to_all(cluster, layout.ep, 8 * (E + 1), ep_span)),
        ("etp", "counts"): ("tp_comm", _small_all_to_all(cluster, layout.etp, 8 * E, etp_span)),
        ("ep", "rows"): ("all_to_all", _all_to_all(cluster, layout.ep, intra * H * b, inter * H * b, peers)),
        ("etp", "rows"): ("tp_comm", _collective(cluster, layout.etp, exchanged * H * b, etp_span, "gather")),
        ("tp", "tokens"): ("tp_comm", _collective(cluster, layout.tp, T * H * b, tp_span, "gather")),
        ("tp", "router logits"): ("tp_comm", _collective(cluster, layout.tp, 4 * T * E, tp_span, "gather")),
        ("tp", "router gradient"): ("tp_comm", _collective(cluster, layout.tp, 4 * H * E, tp_span, "all_reduce")),
    }
    if shadowed:
        price["ep", "shadow weights"] = price["ep", "shadow gradients"] = (
            "replication", _shadow_all_reduce(model, cluster, layout, shadowed))
    out = {"all_to_all": 0.0, "tp_comm": 0.0, **({"replication": 0.0} if shadowed else {})}
    for c in moe_layer_collectives(layout.tp, layout.dp, layout.ep, layout.etp, shadowed=shadowed > 0):
        part, seconds = price[c.group, c.what]
        out[part] += seconds
    return out


def moe_layer_time(model: PlanModel, cluster: ClusterSpec, layout: Layout, load_E=None, placement_E=None,
                   shadow_E=None, senders_PE=None) -> dict[str, float]:
    """Seconds of one MoE layer for one micro-batch, forward + backward, by ``StepCost`` part. ``shadow_E`` (bool
    [E]): shadowed experts, computed by every rank for its own tokens (``senders_PE``: its share; None: uniform)."""
    H, F, F1, E = model.shape.hidden_size, model.expert_ffn, model.expert_width, model.moe.num_experts
    T = layout.micro_batch * model.shape.seq_length
    shadowed = int(np.count_nonzero(shadow_E)) if shadow_E is not None and layout.ep > 1 else 0
    shadow = np.asarray(shadow_E, dtype=bool) if shadowed else None
    routes_PE = ep_routes(model, layout, load_E, senders_PE)
    slot_E = np.arange(E) if placement_E is None else np.asarray(placement_E)
    rank_E = slot_E // (E // layout.ep)
    rows_P = expert_rows(model, layout, load_E, placement_E, shadow)         # rows received, by rank
    busiest = float(layout.etp * computed_routes(routes_PE, rank_E, shadow).max())
    local = E // layout.ep + shadowed                                   # experts a rank runs
    rows = busiest / max(local, 1)                                      # one expert's rows, average
    fc1, fc2 = (2 * rows * H * width / layout.etp for width in (F1, F))
    experts = 3 * (cluster.gemm_time(fc1, local) + cluster.gemm_time(fc2, local))   # per expert, fwd + 2x bwd
    k = model.moe.k
    routes = k * T / layout.tp
    router = 3 * cluster.gemm_time(2 * routes / k * H * E)
    # non-GEMM work: a fixed part, and gathers / scatters / activation over the rows a rank sends and receives
    all_kept = float(routes_PE.sum()) / layout.ep
    dispatch = cluster.moe_layer_overhead + cluster.moe_element_time * (all_kept + busiest / layout.etp) * H
    comm = moe_comm_time(model, cluster, layout, routes_PE, rank_E, shadow, float(rows_P.max()))
    return {"experts": experts, "compute": router, "dispatch": dispatch, **comm}


def dense_layer_time(model: PlanModel, cluster: ClusterSpec, layout: Layout, moe: bool) -> dict[str, float]:
    """Seconds of a layer's attention (and dense MLP unless ``moe``) for one micro-batch, fwd + bwd."""
    H, S, tp = model.shape.hidden_size, model.shape.seq_length, layout.tp
    q, kv = model.shape.query_width, model.shape.kv_width
    T = layout.micro_batch * S
    t = cluster.gemm_time(2 * T * H * (q + 2 * kv) / tp) + cluster.gemm_time(2 * T * q * H / tp)   # QKV, projection
    t += cluster.gemm_time(2 * T * S * q / tp, 2)                # scores and context, all heads
    all_reduces = 2
    if not moe:
        t += cluster.gemm_time(2 * T * H * model.shape.ffn / tp, 2)
        all_reduces = 4
    t += cluster.layer_element_time * T * H / 3                  # non-GEMM work (x3 below: fwd + bwd)
    tp_comm = all_reduces * _collective(cluster, tp, T * H * model.options.activation_bytes, group_span(layout, "tp"),
                                        "all_reduce")
    return {"compute": 3 * t, "tp_comm": tp_comm}


def stage_params(model: PlanModel, layout: Layout, layers: Sequence[int], first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of a stage."""
    moe, H, E = model.moe, model.shape.hidden_size, model.moe.num_experts
    dense = sum(model.dense_layer_params() + (0 if moe.is_moe_layer(i) else model.mlp_params())
                for i in layers) / layout.tp
    dense += sum(H * E for i in layers if moe.is_moe_layer(i))   # routers (replicated)
    if first:
        dense += model.embedding_params() / layout.tp
    if last:
        dense += model.shape.vocab_size * H / layout.tp
    moe_layers = sum(moe.is_moe_layer(i) for i in layers)
    expert = moe_layers * (E // layout.ep) * model.expert_params() / layout.etp
    return dense, expert


def stage_memory(model: PlanModel, layout: Layout, layers: Sequence[int], first: bool, last: bool,
                 micro_batches: int) -> dict[str, float]:
    """Bytes per rank of one stage: weights, grads, optimizer states (by ZeRO stage), activations."""
    dense, expert = stage_params(model, layout, layers, first, last)
    z = layout.zero
    shard_d, shard_e = dense / layout.dp, expert / layout.edp
    o = model.options
    mem = {"weights": (dense + expert) * o.param_bytes,
           "grads": (dense + expert if z < 2 else shard_d + shard_e) * o.grad_bytes,
           "optimizer": (dense + expert if z < 1 else shard_d + shard_e) * o.optimizer_bytes}
    H, F, S, a = model.shape.hidden_size, model.shape.ffn, model.shape.seq_length, model.shape.num_attention_heads
    qkv_context = 2 * (model.shape.query_width + model.shape.kv_width)    # QKV (q + 2 kv) and the context (q)
    T, tp = layout.micro_batch * S, layout.tp
    uniform_rows = float(expert_rows(model, layout, None).max())
    per_micro = 0.0
    for i in layers:
        per_micro += T * H * (2 + qkv_context / (H * tp)) + 2 * a / tp * S * T    # LN, QKV, context, proj; scores
        if model.moe.is_moe_layer(i):
            per_micro += (T / tp * (H + model.moe.num_experts)
                          + uniform_rows * (2 * H + (model.expert_width + model.expert_ffn) / layout.etp))
        else:
            per_micro += 2 * T * H + 2 * T * F / tp
    in_flight = min(layout.pp, micro_batches) if layout.pp > 1 else 1
    mem["activations"] = per_micro * o.activation_bytes * in_flight
    if last:
        mem["activations"] += 2 * T * model.shape.vocab_size / tp * 4                # fp32 logits and their gradient
    return mem


def step_cost(model: PlanModel, cluster: ClusterSpec, layout: Layout, load_ME=None, placement_ME=None,
              shadow_ME=None, senders_MPE=None) -> StepCost:
    """Predicted ``StepCost`` of one optimizer step. ``load_ME``: route fractions ([moe_layers, E], or [E] for all);
    ``placement_ME``, ``shadow_ME``: the same shapes; ``senders_MPE``: [moe_layers, ep, E] (None: uniform)."""
    moe_ids = model.moe_layers
    H, V, m, pp = model.shape.hidden_size, model.shape.vocab_size, layout.gas, layout.pp
    T = layout.micro_batch * model.shape.seq_length
    stages = stage_layers(model, pp)
    per_micro = []          # per stage: dict of per-micro-batch seconds
    memory = []
    dp_comm = optimizer = 0.0
    for s, layers in enumerate(stages):
        first, last = s == 0, s == pp - 1
        parts = {"compute": 0.0, "experts": 0.0, "dispatch": 0.0, "all_to_all": 0.0, "tp_comm": 0.0, "pp_comm": 0.0,
                 "replication": 0.0}
        for i in layers:
            moe = model.moe.is_moe_layer(i)
            for k, v in dense_layer_time(model, cluster, layout, moe).items():
                parts[k] += v
            if moe:
                j = moe_ids.index(i)
                for k, v in moe_layer_time(model, cluster, layout, _row(load_ME, j), _row(placement_ME, j),
                                           _row(shadow_ME, j), _row(senders_MPE, j, 2)).items():
                    parts[k] += v
        if last:
            parts["compute"] += 3 * cluster.gemm_time(2 * T * H * V / layout.tp)
            parts["compute"] += cluster.logit_element_time * T * V / layout.tp    # softmax, loss
        if pp > 1:
            nbytes = T * H * model.options.activation_bytes
            bw, lat = cluster.link(group_span(layout, "pp"))
            parts["pp_comm"] += (int(not first) + int(not last)) * (nbytes / bw + lat)
        per_micro.append(parts)
        memory.append(stage_memory(model, layout, layers, first, last, m))
        dense, expert = stage_params(model, layout, layers, first, last)
        dp_comm = max(dp_comm, _gradient_sync(model, cluster, layout, dense, expert))
        updated = dense + expert if layout.zero == 0 else dense / layout.dp + expert / layout.edp
        fixed, per_param = cluster.engine_step(layout.zero)
        optimizer = max(optimizer, updated / cluster.optimizer_rate + (dense + expert) * per_param)
    # 1F1B: m micro-batches at the slowest stage's pace, plus the fill and drain through the others
    # (each other stage once; s = bubble_speed, 1 on dedicated devices)
    slow = max(range(pp), key=lambda i: sum(per_micro[i].values()))
    speed = bubble_speed(cluster, pp)
    fill = {k: sum(p[k] for i, p in enumerate(per_micro) if i != slow) for k in per_micro[slow]}
    cost = StepCost(**{k: m * v + speed * fill[k] for k, v in per_micro[slow].items()}, dp_comm=dp_comm,
                    optimizer=optimizer)
    layer_slots = m * len(stages[slow]) + speed * sum(len(layers) for i, layers in enumerate(stages) if i != slow)
    cost.overhead = cluster.layer_overhead * layer_slots + cluster.engine_step(layout.zero)[0]
    # the engine's step: gradient-norm and overflow reductions, a few latency-bound all-reduces over the job
    cost.dp_comm += STEP_REDUCTIONS * _collective(cluster, layout.world_size, 8, layout.world_size, "all_reduce")
    cost.bubble = speed * sum(fill.values())
    cost.memory = max(memory, key=lambda d: sum(d.values()))
    return cost


def _gradient_sync(model: PlanModel, cluster: ClusterSpec, layout: Layout, dense: float, expert: float) -> float:
    t = 0.0
    for params, n, span in ((dense, layout.dp, group_span(layout, "dp")),
                            (expert, layout.edp, group_span(layout, "dp", expert_grid=True))):
        if layout.zero == 2:   # partitioned gradients are reduced every micro-batch, weights gathered per step
            t += layout.gas * _collective(cluster, n, params * model.options.grad_bytes, span, "scatter")
            t += _collective(cluster, n, params * model.options.param_bytes, span, "gather")
        else:
            t += _collective(cluster, n, params * model.options.grad_bytes, span, "all_reduce")
    return t


def fits(cost: StepCost, cluster: ClusterSpec) -> bool:
    return cost.memory_total <= cluster.memory * cluster.memory_usable


def _row(values, j: int, ndim: int = 1):
    if values is None:
        return None
    arr = np.asarray(values)
    return arr if arr.ndim == ndim else arr[j]


def tokens_per_step(model: PlanModel) -> int:
    return model.global_batch * model.shape.seq_length
