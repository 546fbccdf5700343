"""The ``bench layer`` command (``run``): the layer bench in this process, or with ``--ep N`` on N
expert-parallel ranks (gloo, one process each).

With ``--ep N``: a world of N ranks with EP = N (``RankLayout.build(N, ep=N)``: dp N, edp 1). Rank r
hosts experts ``[r * E/N, (r + 1) * E/N)`` in our layer and in DeepSpeed's (its own
``ep_size_N`` group over the same ranks), and routes its own ``--tokens`` tokens (tokens are per
rank, like a micro-batch). Every rank runs ``bench_layer`` with ``Ranks(groups)``: a step starts
after a barrier and lasts as long as its slowest rank; memory is the largest rank's; the floor
is each rank's grouped GEMMs on the rows it receives; bytes sent per all-to-all are the mean
over ranks (``traffic.py``). Rank 0's records are printed.

Processes: this process starts N ranks with ``torch.multiprocessing`` (spawn, a file
rendezvous in a temporary directory), each with ``max(1, threads // N)`` threads. Under a
launcher that sets ``RANK`` and ``WORLD_SIZE`` (``deepspeed``, ``torchrun``) this process is one
rank instead (``env://`` rendezvous) and ``WORLD_SIZE`` must equal N.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_plugin_tools.bench.layer import LayerBenchSpec, Ranks, bench_layer, specs_from_args, summary


def run(args: argparse.Namespace) -> None:
    """The ``bench layer`` command: one line per configuration (JSON with ``--json``)."""

    def emit(record: dict) -> None:
        print(json.dumps(record) if args.json else summary(record), flush=True)

    if args.ep > 1:
        if args.vs == "megatron":
            raise ValueError("--vs megatron runs on one rank (--ep 1)")
        run_expert_parallel(args, emit)
        return
    torch.set_num_threads(args.threads)
    for spec in specs_from_args(args):
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep stdout for results
            record = bench_layer(spec)
        emit(record)


def run_expert_parallel(args: argparse.Namespace, emit) -> None:
    """Run every configuration of ``args`` on ``args.ep`` ranks; ``emit(record)`` on rank 0's records."""
    specs = specs_from_args(args)
    world = args.ep
    threads = max(1, args.threads // world)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # started by a launcher: this process is one rank
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"--ep {world} but the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
        rank = int(os.environ["RANK"])
        records = rank_main(rank, world, specs, threads, "env://")
        if rank == 0:
            for record in records:
                emit(record)
        return
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as tmp:
        mp.spawn(_spawned, args=(world, specs, threads, tmp), nprocs=world, join=True)
        for record in json.loads((Path(tmp) / "records.json").read_text()):
            emit(record)


def _spawned(rank: int, world: int, specs: list[LayerBenchSpec], threads: int, tmp: str) -> None:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
        records = rank_main(rank, world, specs, threads, f"file://{tmp}/store")
    if rank == 0:
        (Path(tmp) / "records.json").write_text(json.dumps(records))


def rank_main(rank: int, world: int, specs: list[LayerBenchSpec], threads: int, init_method: str) -> list[dict]:
    """One rank of the job: groups, every configuration, teardown. Uses the default group when
    one exists (a test harness's), else creates it with ``init_method``."""
    from moe_plugin_tools.bench.deepspeed_moe import forget_deepspeed_groups
    from moe_plugin_tools.bench.device import distributed_backend
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout

    torch.set_num_threads(threads)
    backend = "gloo" if specs[0].target.on_cpu else distributed_backend(rank)
    owns_world = not dist.is_initialized()
    if owns_world:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    groups = build_process_groups(RankLayout.build(world, ep=world), backend=backend)
    try:
        return [bench_layer(spec, Ranks(groups, spec.device)) for spec in specs]
    finally:
        if "deepspeed.utils.groups" in sys.modules:
            forget_deepspeed_groups(world)
        destroy_process_groups(groups)
        if owns_world:
            dist.destroy_process_group()
