"""Calibration: measure this machine as a training job of N gloo ranks uses it (GEMMs, collectives, Adam,
and the real pieces of a step: ``calibrate_pieces.py``), and write the cluster JSON the cost model reads
(``moe-plugin plan --calibrate out.json --ranks N``; raw numbers in ``<out>.measurements.json``).
What is measured and how: docs/planner.md, *Calibration*.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

GEMM_SIZES = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 1024, 256), (512, 512, 512), (1024, 1024, 256))
GEMM_SECONDS = 0.3                 # per size and repeat
SMALL, LARGE = 1, 1 << 20          # float32 elements of the latency and the bandwidth collectives


def _median_time(fn, repeat: int, barrier=None) -> float:
    times = []
    for _ in range(repeat):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(rank: int, world: int) -> dict:
    """One rank's measurements (every rank runs the same, together)."""
    import torch
    import torch.distributed as dist

    barrier = dist.barrier if world > 1 else None
    out: dict = {"gemm": []}
    for m, k, n in GEMM_SIZES:   # every rank multiplies for the same wall time: they overlap as in a job
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        rates = []
        for _ in range(3):
            if barrier is not None:
                barrier()
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < GEMM_SECONDS:
                torch.mm(a, b)
                count += 1
            rates.append(2.0 * m * k * n * count / (time.perf_counter() - start))
        out["gemm"].append([2.0 * m * k * n, statistics.median(rates)])
    if world > 1:
        for name, size in (("all_reduce_small", SMALL), ("all_reduce_large", LARGE)):
            x = torch.ones(size)
            out[name] = _median_time(lambda: dist.all_reduce(x), 10 if size == SMALL else 5, barrier)
        for name, size in (("all_to_all_small", SMALL * world), ("all_to_all_large", LARGE)):
            x, y = torch.ones(size), torch.empty(size)
            out[name] = _median_time(lambda: dist.all_to_all_single(y, x), 10 if size <= world else 5, barrier)
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()
    out["adam_s_per_param"] = _median_time(opt.step, 5, barrier) / sum(p.numel() for p in params)
    return out


def cluster_from(measurements: list[dict], world: int) -> dict:
    """The cluster JSON (``ClusterSpec`` fields) from every rank's measurements, as the ranks' mean."""
    gemm = [[flops, sum(r["gemm"][i][1] for r in measurements) / len(measurements)]
            for i, (flops, _) in enumerate(measurements[0]["gemm"])]
    peak = max(rate for _, rate in gemm)
    points: dict[float, float] = {}
    for flops, rate in sorted(gemm):
        points[flops] = max(points.get(flops, 0.0), rate / peak)
    mean = lambda key: sum(r[key] for r in measurements) / len(measurements)   # noqa: E731
    spec = {"name": f"this machine ({os.cpu_count()} cores, {world} gloo ranks)", "nodes": 1,
            "gpus_per_node": world, "flops": peak, "gemm_efficiency": [[f, round(e, 4)] for f, e in points.items()],
            "memory": _memory_bytes() / world, "memory_usable": 0.8,
            "optimizer_rate": 1.0 / mean("adam_s_per_param"),
            "oversubscription": max(1.0, world / (os.cpu_count() or 1))}
    if world > 1:
        n = world
        lat_ar = mean("all_reduce_small") / (2 * (n - 1))
        lat_a2a = mean("all_to_all_small") / (n - 1)
        nbytes = 4 * LARGE
        bw_a2a = (n - 1) / n * nbytes / max(mean("all_to_all_large") - lat_a2a * (n - 1), 1e-9)
        bw_ar = 2 * (n - 1) / n * nbytes / max(mean("all_reduce_large") - lat_ar * 2 * (n - 1), 1e-9)
        spec.update(intra_bandwidth=bw_a2a, inter_bandwidth=bw_a2a, intra_latency=lat_a2a, inter_latency=lat_a2a,
                    allreduce_bandwidth=bw_ar, allreduce_latency=lat_ar)
    else:
        spec.update(intra_bandwidth=1e10, inter_bandwidth=1e10)
    if "pieces" in measurements[0]:
        from moe_plugin.planner.calibrate_pieces import fit

        spec = fit(spec, [r["pieces"] for r in measurements], world)
    return spec


def _memory_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9


def _spawned(rank: int, world: int, threads: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from moe_plugin.compat.process_exit import exit_process
    from moe_plugin.planner.calibrate_pieces import measure_pieces

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    with contextlib.redirect_stdout(sys.stderr):   # DeepSpeed logs to stdout
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        try:
            result = measure(rank, world)
            result["pieces"] = measure_pieces(rank, world)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    exit_process(0)   # not the interpreter's exit (compat/process_exit.py)


def run_calibration(world: int) -> tuple[dict, list[dict]]:
    """Measure on ``world`` local ranks; returns (cluster JSON dict, per-rank measurements)."""
    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="moe_calibrate_") as tmp:
        mp.spawn(_spawned, args=(world, threads, tmp), nprocs=world, join=True)
        measurements = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    return cluster_from(measurements, world), measurements


def calibrate(out: Path, world: int) -> dict:
    """``moe-plugin plan --calibrate out.json --ranks N``: measure, write, print a summary."""
    from moe_plugin.planner.spec import ClusterSpec

    spec, measurements = run_calibration(world)
    ClusterSpec.load(spec)   # what it wrote must load
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(spec, indent=2) + "\n")
    out.with_suffix(".measurements.json").write_text(json.dumps(measurements, indent=2) + "\n")
    print(f"{spec['name']}: GEMM peak {spec['flops'] / 1e9:.1f} GFLOP/s per rank (efficiency "
          f"{', '.join(f'{e:.2f}' for _, e in spec['gemm_efficiency'])}), link {spec['intra_bandwidth'] / 1e9:.2f} GB/s, "
          f"latency {1e6 * spec['intra_latency']:.0f} us, Adam {spec['optimizer_rate'] / 1e6:.0f} M params/s, "
          f"layer {1e3 * spec['layer_overhead']:.1f} ms + {1e9 * spec['layer_element_time']:.0f} ns/element, MoE "
          f"{1e3 * spec['moe_layer_overhead']:.1f} ms + {1e9 * spec['moe_element_time']:.0f} ns/element, engine "
          f"(ZeRO 0/1/2) {'/'.join(f'{1e3 * x:.0f}' for x in spec['zero_step_overhead'])} ms + "
          f"{'/'.join(f'{1e9 * x:.0f}' for x in spec['zero_param_time'])} ns/param; wrote {out}")
    return spec
