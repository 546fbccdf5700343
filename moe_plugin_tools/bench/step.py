"""``moe-plugin bench step``: whole training steps of a tiny GPT-MoE, ours against DeepSpeed's MoE.

Both models (``gpt_models.py``: the same Megatron-Core GPTModel, dense weights, expert weights,
routing, ZeRO stage and AdamW; MoE MLPs the plugin's or ``deepspeed.moe.layer.MoE``) are built
first, in one process per rank, then trained on the same random tokens (each rank its own
micro-batch, batch r at round r for both). A step is ``engine(...)`` forward, ``engine.backward``
and ``engine.step()``; the twin's loss adds ``aux_loss_coeff * l_aux`` (ours attaches it inside
the layer). Round r runs both models, ours first on even rounds, the twin first on odd ones;
every step starts after a barrier over the job and lasts as long as its slowest rank. The first
``warmup`` rounds are not timed; the record has medians over ``rounds``.

Also in the record: the phases of a step (``forward``, ``backward``, ``optimizer``, each the
slowest rank's) and ``moe_forward`` / ``moe_backward``: the MoE MLPs' share of ``forward`` and
``backward`` (hooks, ``MoETimer``; the rest of the model is the same code in both);
``*_cpu_ms``: the CPU time of a step summed over the ranks (median; all threads of the process,
gloo's included), less sensitive than wall time to other processes on a shared machine, and
``deepspeed_over_ours_cpu``; ``*_phases_cpu_ms``: the phases in CPU time of the main thread,
summed over the ranks;
every round's language-model loss (mean over ranks) of both models, ``step0_loss_diff`` (the
models start equal: with no dropped route the step-0 losses agree to rounding; with drops
DeepSpeed renormalises the gates of a token whose 2nd route was dropped, ours does not, so they
differ a little), ``same_initial_weights``; our expert load of the last step
(``ExpertMetrics.log_line``); ``loadavg`` and ``others_cpu`` as in ``bench layer``.

Processes: ``--ranks N`` starts N gloo ranks itself (``torch.multiprocessing`` spawn, a file
rendezvous in a temporary directory), each with ``max(1, threads // N)`` threads; under a launcher
that sets ``RANK`` and ``WORLD_SIZE`` (``deepspeed --num_gpus N --module moe_plugin_tools.bench.step
--ranks N ...``, checked on CPU; ``torchrun``) this process is one rank.

Device and dtype (``--device``, ``--dtype``; ``device.py``): the engine puts the model on its
accelerator's device, so ``--device`` must be of that type; off the CPU each rank takes device
``LOCAL_RANK`` and the accelerator's backend (nccl on CUDA), and every clock reading (phases and
MoE hooks included) follows the accelerator's ``synchronize``; ``*_peak_bytes`` is then the
device's peak allocated bytes during a step (``max_memory_allocated``, the largest rank, the
largest timed round; model, gradients and optimizer states included), None on the CPU. ``--dtype bf16`` / ``fp16`` adds
DeepSpeed's ``"bf16"`` / ``"fp16"`` block to both engines' JSON (the engine casts the model;
ZeRO keeps fp32 master weights) and sets Megatron's ``bf16`` / ``fp16`` and ``params_dtype``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.profiler import record_function

from moe_plugin_tools.bench.gpt_models import GPTSpec
from moe_plugin_tools.bench.machine import cpu_seconds, loadavg, others_share

MODELS = ("ours", "deepspeed")
PHASES = ("forward", "backward", "optimizer", "moe_forward", "moe_backward")


class _World:
    """``bench layer``'s ``Ranks`` interface over the whole job (for ``others_share``); the values
    travel on ``device`` (the backend's: the CPU for gloo, the rank's GPU for nccl)."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def reduce(self, values: list[float], op: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()


def _clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread)."""
    return time.perf_counter(), time.thread_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


class MoETimer:
    """Wall and CPU (this thread's) seconds spent in the forward and the backward of some modules
    (the MoE MLPs) since ``reset()``.

    Forward: forward pre-hook to forward hook. Backward: from the moment the gradient of the
    module's output is ready (a tensor hook on the output) to the moment the gradient of its input
    is (a tensor hook on the input; the MLP's input feeds nothing else in a transformer layer).
    Autograd may run a few small nodes of the residual branch in between; they are counted too.
    On CPU, backward runs on the thread that called it, so its CPU time is this thread's.
    """

    def __init__(self, modules: list[torch.nn.Module], sync: Callable[[], None] = lambda: None):
        self.sync = sync   # the device's synchronize, before every clock reading (off the CPU)
        self.forward = [0.0, 0.0]
        self.backward = [0.0, 0.0]
        self._start: dict[int, tuple[float, float]] = {}
        self._backward_start: dict[int, tuple[float, float]] = {}
        self._hooks = [h for m in modules for h in (m.register_forward_pre_hook(self._begin),
                                                      m.register_forward_hook(self._end))]

    def _begin(self, module: torch.nn.Module, inputs: tuple) -> None:
        key = id(module)
        if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: self._backward_end(key))
        self.sync()
        self._start[key] = _clock()

    def _end(self, module: torch.nn.Module, _inputs: tuple, output: Any) -> None:
        key = id(module)
        self.sync()
        self._add(self.forward, _since(self._start[key]))
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._backward_begin(key))

    def _backward_begin(self, key: int) -> None:
        self.sync()
        self._backward_start[key] = _clock()

    def _backward_end(self, key: int) -> None:
        self.sync()
        start = self._backward_start.pop(key, None)
        if start is not None:
            self._add(self.backward, _since(start))

    @staticmethod
    def _add(total: list[float], delta: tuple[float, float]) -> None:
        total[0] += delta[0]
        total[1] += delta[1]

    def reset(self) -> None:
        self.forward = [0.0, 0.0]
        self.backward = [0.0, 0.0]
        self._backward_start.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def make_batches(spec: GPTSpec, count: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches (ids, positions, labels) of random tokens for this rank."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    out = []
    for _ in range(count):
        ids = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), torch.arange(spec.seq).expand(spec.micro_batch, spec.seq),
                    ids[:, 1:].contiguous()))
    return out


def _trainer(engine: Any, timer: MoETimer, aux: Optional[Callable[[], torch.Tensor]]):
    """A function that trains one step on a batch: returns the LM loss and, per phase of ``PHASES``
    (forward, backward, optimizer, moe_forward, moe_backward), (wall, this thread's CPU) seconds;
    each phase ends with ``timer.sync()``."""

    def step(batch) -> tuple[float, list[tuple[float, float]]]:
        ids, pos, labels = batch
        timer.reset()
        t0 = _clock()
        with record_function("step.forward"):    # the phase scopes of ``step_parts`` (--parts)
            lm = engine(ids, pos, None, labels=labels).float().mean()
            loss = lm if aux is None else lm + aux()
            timer.sync()
        forward = _since(t0)
        t1 = _clock()
        with record_function("step.backward"):
            engine.backward(loss)
            timer.sync()
        backward = _since(t1)
        t2 = _clock()
        with record_function("optimizer"):
            engine.step()
            timer.sync()
        optimizer = _since(t2)
        return float(lm.detach()), [forward, backward, optimizer, tuple(timer.forward), tuple(timer.backward)]

    return step


def bench_step(spec: GPTSpec, rounds: int, warmup: int, parts: int = 0) -> dict:
    """Build both models and time them (module docstring); every rank calls it with torch.distributed
    initialised (gloo). Returns the record (the same on every rank). ``parts``: profile that many
    more steps of each model (``step_parts.py``) for ``{model}_parts_ms``, and time 2 x that many
    of ours for ``ours_extra_round_ms`` (``_round_cost``)."""
    from moe_plugin_tools.bench.gpt_models import build_deepspeed_twin, build_ours, same_weights, twin_aux_loss
    from moe_plugin.integration.megatron import MegatronMoEMLP
    from moe_plugin.integration.monitor import ExpertMetrics

    from moe_plugin_tools.bench.device import DTYPES, Target

    world, rank = dist.get_world_size(), dist.get_rank()
    target = Target(spec.device, spec.dtype)
    sync = target.sync
    ours = build_ours(spec, world)
    try:
        twin, wrappers = build_deepspeed_twin(spec, ours, world)
        same = same_weights(ours.engine, twin)
        ours_moe = [m for m in ours.engine.module.modules() if isinstance(m, MegatronMoEMLP)]
        timers = {"ours": MoETimer(ours_moe, sync), "deepspeed": MoETimer(wrappers, sync)}
        steps = {"ours": _trainer(ours.engine, timers["ours"], None),
                 "deepspeed": _trainer(twin, timers["deepspeed"], lambda: twin_aux_loss(spec, wrappers))}
        metrics = ExpertMetrics(ours.engine.module, per_expert=False)
        batches = [tuple(t.to(ours.engine.device) for t in batch)
                   for batch in make_batches(spec, warmup + rounds, rank)]
        world_ranks = _World(spec.device)
        times: dict[str, list[list[float]]] = {name: [] for name in MODELS}
        losses: dict[str, list[float]] = {name: [] for name in MODELS}
        peaks: dict[str, list[float]] = {name: [] for name in MODELS}
        busy_before = None
        for r, batch in enumerate(batches):
            if r == warmup:
                busy_before = cpu_seconds()
            for name in (MODELS if r % 2 == 0 else MODELS[::-1]):
                sync()
                target.reset_peak()
                dist.barrier()
                cpu_start = _process_cpu_seconds()
                start = time.perf_counter()
                lm, phases = steps[name](batch)
                total = time.perf_counter() - start
                cpu = _process_cpu_seconds() - cpu_start
                slowest = world_ranks.reduce([total, *(wall for wall, _ in phases)], "max")
                lm_sum, *cpu_sums = world_ranks.reduce([lm, cpu, *(c for _, c in phases)], "sum")
                losses[name].append(lm_sum / world)
                if r >= warmup:   # [wall total, wall phases..., CPU total, CPU phases...] in ms
                    times[name].append([1e3 * s for s in slowest + cpu_sums])
                    if target.peak_bytes() is not None:
                        peaks[name].append(world_ranks.reduce([target.peak_bytes()], "max")[0])
                if name == "ours":
                    metrics.collect()   # outside the timed region (a small all-reduce per layer)
        busy_after = cpu_seconds()
        profiled = {name: _parts(model.module, steps[name], batches, parts, spec.device)
                    for name, model in (("ours", ours.engine), ("deepspeed", twin)) if parts}
        round_ms = _round_cost(ours_moe, steps["ours"], batches, parts, ours.groups.ep, spec.device) if parts else None
        for timer in timers.values():
            timer.close()
        metrics.close()
        record = {"bench": "step", "ranks": world, **asdict(spec), "rounds": rounds, "warmup": warmup,
                  "threads": torch.get_num_threads(), "dtype": str(DTYPES[spec.dtype]).removeprefix("torch."),
                  "moe_layers": [m.layer_index for m in ours_moe], "tokens_per_rank": spec.seq * spec.micro_batch,
                  "params_per_rank": {"ours": _count(ours.engine.module), "deepspeed": _count(twin.module)}}
        for name in MODELS:
            record[f"{name}_ms"] = round(statistics.median(t[0] for t in times[name]), 2)
        record["deepspeed_over_ours"] = round(record["deepspeed_ms"] / record["ours_ms"], 3)
        for name in MODELS:   # off the CPU: the device's peak allocated bytes in a step, largest rank
            record[f"{name}_peak_bytes"] = int(max(peaks[name])) if peaks[name] else None
        record.update({f"{name}_rounds_ms": [round(t[0]) for t in times[name]] for name in MODELS})
        n = 1 + len(PHASES)
        for name in MODELS:
            record[f"{name}_cpu_ms"] = round(statistics.median(t[n] for t in times[name]), 2)
        record["deepspeed_over_ours_cpu"] = round(record["deepspeed_cpu_ms"] / record["ours_cpu_ms"], 3)
        for name in MODELS:
            record[f"{name}_phases_ms"] = {p: round(statistics.median(t[i + 1] for t in times[name]), 2)
                                           for i, p in enumerate(PHASES)}
            record[f"{name}_phases_cpu_ms"] = {p: round(statistics.median(t[n + i + 1] for t in times[name]), 2)
                                               for i, p in enumerate(PHASES)}
        record.update({f"{name}_parts_ms": {k: round(v, 2) for k, v in p.items()} for name, p in profiled.items()})
        if round_ms is not None:
            record["ours_extra_round_ms"] = round(round_ms, 2)
        record.update({f"{name}_losses": [round(v, 5) for v in losses[name]] for name in MODELS})
        record["step0_loss_diff"] = abs(losses["ours"][0] - losses["deepspeed"][0])
        record["same_initial_weights"] = same
        record["moe_metrics"] = metrics.log_line()
        record["loadavg"] = loadavg()
        record["others_cpu"] = others_share(busy_before, busy_after, world_ranks)
        return record
    finally:
        ours.close()


def _parts(model: torch.nn.Module, step: Callable, batches: list, count: int, device: str) -> dict[str, float]:
    """Where ``count`` more steps of a model spend their time, mean over the ranks (``step_parts``)."""
    from moe_plugin_tools.bench.step_parts import PartsProfile, over_ranks

    profile = PartsProfile(model)
    dist.barrier()
    profile.start()
    for i in range(count):
        step(batches[i % len(batches)])
    return over_ranks(profile.stop(count), device)["mean"]


def _round_cost(moe: list[torch.nn.Module], step: Callable, batches: list, count: int, group, device: str,
                extra: int = 2) -> float:
    """What one more collective round costs inside our training step: ``count`` steps with ``extra``
    tiny all-to-alls over ``group`` (the EP group) before every MoE MLP, ``count`` steps without, in
    alternation; the median difference of the slowest rank's step per added round (ms)."""
    added = {"on": False}

    def rounds(_module, _inputs):
        if added["on"]:
            for _ in range(extra):
                ones = torch.ones(dist.get_world_size(group), 2, dtype=torch.long, device=device)
                dist.all_to_all_single(torch.empty_like(ones), ones, group=group)

    hooks = [m.register_forward_pre_hook(rounds) for m in moe]
    times: dict[bool, list[float]] = {True: [], False: []}
    world = _World(device)
    try:
        for i in range(2 * count):
            added["on"] = i % 2 == 0
            dist.barrier()
            start = time.perf_counter()
            step(batches[i % len(batches)])
            times[added["on"]].append(world.reduce([time.perf_counter() - start], "max")[0])
    finally:
        for h in hooks:
            h.remove()
    return 1e3 * (statistics.median(times[True]) - statistics.median(times[False])) / (extra * len(moe))


def _process_cpu_seconds() -> float:
    """CPU seconds of this process, all its threads (gloo's included)."""
    t = os.times()
    return t.user + t.system


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- processes -----------------------------------------------------------------------------------
def spec_from_args(args: argparse.Namespace) -> GPTSpec:
    return GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, experts=args.experts,
                   ep=args.ep or args.ranks, moe_every=args.moe_every, seq=args.seq, micro_batch=args.micro_batch,
                   vocab=args.vocab, k=args.top_k, capacity_factor=args.capacity_factor,
                   min_capacity=args.min_capacity, dropless=args.dropless, zero_stage=args.zero_stage,
                   seed=args.seed, device=args.device, dtype=args.dtype)


def run(args: argparse.Namespace) -> None:
    """The ``bench step`` command: one line (JSON with ``--json``) from rank 0."""
    from moe_plugin_tools.bench.device import accelerator, check_device

    args.device = check_device(args.device)
    if torch.device(args.device).type != accelerator().device_name():
        raise ValueError(f"--device {args.device}: bench step trains where DeepSpeed's engine puts the model, "
                         f"on its accelerator's device ({accelerator().device_name()!r})")
    spec = spec_from_args(args)
    world = args.ranks
    if spec.experts % spec.ep or world % spec.ep:
        raise ValueError(f"--ep {spec.ep} must divide --experts {spec.experts} and --ranks {world}")
    threads = max(1, args.threads // world)

    def emit(record: dict) -> None:
        print(json.dumps(record) if args.json else summary(record), flush=True)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # started by a launcher: this process is one rank
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"--ranks {world} but the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
        rank = int(os.environ["RANK"])
        record = rank_main(rank, world, spec, args.rounds, args.warmup, threads, "env://", args.parts)
        if rank == 0:
            emit(record)
        return
    with tempfile.TemporaryDirectory(prefix="moe_bench_step_") as tmp:
        mp.spawn(_spawned, args=(world, spec, args.rounds, args.warmup, threads, tmp, args.parts), nprocs=world,
                 join=True)
        emit(json.loads((Path(tmp) / "record.json").read_text()))


def _spawned(rank: int, world: int, spec: GPTSpec, rounds: int, warmup: int, threads: int, tmp: str,
             parts: int = 0) -> None:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep stdout for results
        record = rank_main(rank, world, spec, rounds, warmup, threads, f"file://{tmp}/store", parts)
    if rank == 0:
        (Path(tmp) / "record.json").write_text(json.dumps(record))


def rank_main(rank: int, world: int, spec: GPTSpec, rounds: int, warmup: int, threads: int,
              init_method: str, parts: int = 0) -> dict:
    """One rank: the default group (unless one exists, a test harness's), the bench, teardown."""
    torch.set_num_threads(threads)
    # what the deepspeed launcher sets (DeepSpeed's engine asserts LOCAL_RANK)
    os.environ.update(RANK=str(rank), LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)), WORLD_SIZE=str(world))
    backend = "gloo"
    if torch.device(spec.device).type != "cpu":   # e.g. nccl on cuda:LOCAL_RANK
        from moe_plugin_tools.bench.device import distributed_backend

        backend = distributed_backend(rank)
    owns_world = not dist.is_initialized()
    if owns_world:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        return bench_step(spec, rounds, warmup, parts)
    finally:
        if owns_world:
            dist.destroy_process_group()


def summary(record: dict) -> str:
    """One human-readable line of a record."""
    phases = " | ".join(f"{n}: " + ", ".join(f"{p} {v:.0f}" for p, v in record[f"{n}_phases_ms"].items())
                        for n in MODELS)
    routing = "dropless" if record["dropless"] else f"cf={record['capacity_factor']}"
    return (f"ranks={record['ranks']} ep={record['ep']} L={record['layers']} H={record['hidden']} F={record['ffn']} "
            f"E={record['experts']} {routing} moe_layers={record['moe_layers']} S={record['seq']} "
            f"B={record['micro_batch']} V={record['vocab']}: ours {record['ours_ms']:.0f} ms, deepspeed "
            f"{record['deepspeed_ms']:.0f} ms, deepspeed/ours {record['deepspeed_over_ours']} (CPU time "
            f"{record['deepspeed_over_ours_cpu']}) | {phases} | {record['moe_metrics']} | load avg "
            f"{record['loadavg']}, others_cpu {record['others_cpu']}")


if __name__ == "__main__":   # deepspeed --num_gpus N --module moe_plugin_tools.bench.step --ranks N ...
    from moe_plugin.configs.report import exit_on_config_error
    from moe_plugin_tools.bench.args import parse_step_args

    with exit_on_config_error(ValueError):   # as ``moe-plugin bench step`` does
        run(parse_step_args(sys.argv[1:]))
    from moe_plugin.compat.process_exit import exit_process

    exit_process(0)   # not the interpreter's exit (moe_plugin/compat/process_exit.py)
