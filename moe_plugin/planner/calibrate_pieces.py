"""Calibration of the real pieces of a training step on N local ranks (a Megatron layer, the embedding
and loss, the plugin's MoE layer, the DeepSpeed engine's step under each ZeRO stage), each at two sizes,
and the non-GEMM cluster fields fitted from them: what the cost model already prices is subtracted and
a line fitted to the rest. Shapes are fixed (``PIECE_SHAPE``, ``PIECE_MOE``). docs/planner.md, *Calibration*.
"""
from __future__ import annotations

import statistics
import time

PIECE_SHAPE = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, vocab_size=1024,
                   seq_length=128)
PIECE_MOE = dict(num_experts=8, router="gshard", capacity_factor=1.25)   # fp32: no bf16
TOKENS = (1, 4)                       # micro-batch sizes (sequences of PIECE_SHAPE's) of the layer pieces
PARAMS = (1 << 19, 1 << 22)           # parameter counts of the engine pieces
TENSORS = 16
ZERO = (0, 1, 2)
ITERS = 7
WARMUP = 2


def _model(world: int):
    from moe_plugin.planner.spec import PlanModel

    return PlanModel.build({"train_batch_size": world, "moe": PIECE_MOE}, PIECE_SHAPE, {"micro_batches": [1]})


def _layout(world: int, ep: int = 1, zero: int = 1, micro_batch: int = 1):
    from moe_plugin.planner.spec import Layout

    return Layout(tp=1, pp=1, ep=ep, etp=1, dp=world, zero=zero, micro_batch=micro_batch, gas=1)


def _timed(fn, iters: int = ITERS) -> float:
    """Median over ``iters`` (after ``WARMUP``) of the ranks' mean seconds of ``fn()``: the slowest rank of each
    piece is a different one where ranks share cores, so per-piece maxima would overstate a step."""
    import torch
    import torch.distributed as dist

    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        mean = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(mean)
        times.append(float(mean) / dist.get_world_size())
    return statistics.median(times)


def _initialize(world: int, ep: int, zero: int, params: int):
    """``initialize`` of a bag of ``params`` parameters: data parallel over ``world``, EP ``ep``, ZeRO ``zero``."""
    import torch

    import moe_plugin
    from moe_plugin.planner.search import ds_config

    config = ds_config(_model(world), _layout(world, ep, zero))
    config["optimizer"]["params"]["torch_adam"] = True
    config["steps_per_print"] = 10 ** 9

    class Bag(torch.nn.Module):   # next to no FLOPs: the loss is the sum of the parameters
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(params // TENSORS) * 1e-3)
                                                  for _ in range(TENSORS))

        def forward(self, x):
            return sum(w.sum() for w in self.weights) * x.mean()

    return moe_plugin.initialize(config, lambda moe_config, groups: Bag())


def measure_pieces(rank: int, world: int) -> dict:
    """Inside the ranks (default process group up): seconds of every piece."""
    import torch

    torch.manual_seed(rank)
    model, out = _model(world), {"moe": {}, "dense": [], "engine": {}}
    for ep in sorted({1, world}):
        result = _initialize(world, ep, 1, PARAMS[0])
        try:
            out["moe"][str(ep)] = [_time_moe(model, result, mb) for mb in TOKENS]
            if ep == 1:
                out["dense"] = [_time_dense(model, mb) for mb in TOKENS]
                out["head"] = [_time_head(model, mb) for mb in TOKENS]
        finally:
            result.close()
    for zero in ZERO:
        out["engine"][str(zero)] = []
        for params in PARAMS:
            result = _initialize(world, 1, zero, params)
            try:
                out["engine"][str(zero)].append(_time_engine(result.engine))
            finally:
                result.close()
    return out


def _time_moe(model, result, micro_batch: int) -> float:
    import torch

    from moe_plugin.layers import MoELayer

    shape = model.shape
    layer = MoELayer(result.moe_config, shape.hidden_size, shape.ffn, result.groups, seed=0).train()
    x = torch.randn(shape.seq_length, micro_batch, shape.hidden_size, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        for p in (x, *layer.parameters()):
            p.grad = None
        layer(x)[0].backward(grad)
    return _timed(step)


def _time_dense(model, micro_batch: int) -> float:
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from moe_plugin.integration.megatron import cpu_friendly_spec

    config = TransformerConfig(**{**model.shape.transformer_fields(), "num_layers": 1}, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False)
    layer = build_module(cpu_friendly_spec(get_gpt_layer_local_spec()), config=config, layer_number=1).train()
    x = torch.randn(model.shape.seq_length, micro_batch, model.shape.hidden_size, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        for p in (x, *layer.parameters()):
            p.grad = None
        out = layer(x, attention_mask=None)
        (out[0] if isinstance(out, tuple) else out).backward(grad)
    return _timed(step)


def _time_head(model, micro_batch: int) -> float:
    """Megatron's vocab-parallel embedding and cross entropy, forward + backward: the head's non-GEMM work
    (the output layer's GEMMs are the GEMM curve's)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    S, V = model.shape.seq_length, model.shape.vocab_size
    config = TransformerConfig(**{**model.shape.transformer_fields(), "num_layers": 1},
                               use_cpu_initialization=True, gradient_accumulation_fusion=False)
    embedding = tensor_parallel.VocabParallelEmbedding(V, model.shape.hidden_size, init_method=torch.nn.init.normal_,
                                                       config=config)
    tokens = torch.randint(0, V, (micro_batch, S))
    labels = torch.randint(0, V, (S, micro_batch))
    logits = torch.randn(S, micro_batch, V, requires_grad=True)

    def step() -> None:
        for p in (logits, *embedding.parameters()):
            p.grad = None
        embedding(tokens).sum().backward()
        tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean().backward()
    return _timed(step)


def _time_engine(engine) -> float:
    import torch

    x = torch.ones(1)

    def step() -> None:
        engine.backward(engine(x))
        engine.step()
    return _timed(step)


def fit(spec: dict, pieces: list[dict], world: int) -> dict:
    """The cluster JSON ``spec`` (micro-benchmark fields) with the piece-fitted fields added; ``pieces``: every rank's
    ``measure_pieces`` (identical: the times are the ranks' mean)."""
    from moe_plugin.planner import cost_model as cm
    from moe_plugin.planner.spec import ClusterSpec

    piece = _mean(pieces)
    model = _model(world)
    zeroed = dict(layer_overhead=0.0, layer_element_time=0.0, logit_element_time=0.0, moe_layer_overhead=0.0,
                  moe_element_time=0.0, zero_step_overhead=[0.0, 0.0, 0.0], zero_param_time=[0.0, 0.0, 0.0])
    cluster = ClusterSpec.load({**spec, **zeroed})
    fitted: dict = {}

    # dense layer: time - its GEMMs = layer_overhead + layer_element_time * T * H
    S, H, V = model.shape.seq_length, model.shape.hidden_size, model.shape.vocab_size
    xs = [mb * S * H for mb in TOKENS]
    rest = [t - cm.dense_layer_time(model, cluster, _layout(world, micro_batch=mb), False)["compute"]
            for t, mb in zip(piece["dense"], TOKENS)]
    fitted["layer_overhead"], fitted["layer_element_time"] = _line(xs, rest)

    # embedding and loss: time = intercept + logit_element_time * T * V
    fitted["logit_element_time"] = _line([mb * S * V for mb in TOKENS], piece["head"])[1]

    # MoE layer at EP 1 and EP N, both sizes: time - its GEMMs and collectives (the link latency as
    # measured) = moe_layer_overhead + moe_element_time * routed elements (least squares)
    xs, rest = [], []
    for ep in sorted({1, world}):
        for t, mb in zip(piece["moe"][str(ep)], TOKENS):
            xs.append(_routed_elements(model, world, ep, mb))
            rest.append(t - sum(cm.moe_layer_time(model, cluster, _layout(world, ep=ep, micro_batch=mb)).values()))
    fitted["moe_layer_overhead"], fitted["moe_element_time"] = _line(xs, rest)

    # engine: time - Adam on the shard - gradient all-reduce = zero_step_overhead + zero_param_time * P
    overhead, per_param = [], []
    for zero in ZERO:
        lay = _layout(world, zero=zero)
        rest = []
        for t, params in zip(piece["engine"][str(zero)], PARAMS):
            updated = params if zero == 0 else params / world
            sync = cm._gradient_sync(model, cluster, lay, params, 0.0)
            rest.append(t - updated / cluster.optimizer_rate - sync)
        a, b = _line(list(PARAMS), rest)
        overhead.append(a)
        per_param.append(b)
    fitted["zero_step_overhead"], fitted["zero_param_time"] = overhead, per_param
    fitted["step_overhead"] = overhead[1]
    return {**spec, **fitted}


def _routed_elements(model, world: int, ep: int, micro_batch: int) -> float:
    """Rows a rank sends plus rows it receives, times hidden (what ``moe_element_time`` prices)."""
    from moe_plugin.planner.cost_model import expert_rows

    lay = _layout(world, ep=ep, micro_batch=micro_batch)
    rows = expert_rows(model, lay, None)
    return (float(rows.sum()) / lay.ep + float(rows.max())) * model.shape.hidden_size


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, both clamped at 0 (a cost is never negative)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return max(0.0, my - slope * mx), slope


def _mean(pieces: list[dict]) -> dict:
    def avg(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: avg([v[k] for v in values]) for k in first}
        if isinstance(first, list):
            return [avg([v[i] for v in values]) for i in range(len(first))]
        return statistics.mean(values)
    return avg(pieces)
