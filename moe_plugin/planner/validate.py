"""``moe-plugin plan --validate``: the cost model's prediction against measured training steps.

For each world size, one job of gloo ranks calibrates, times whole steps of the model of ``VALIDATION_SHAPE``
and ``VALIDATION_MOE`` in each of ``LAYOUTS`` on the real stack, and calibrates again; the prediction from the
mean calibration is compared with the median step (``DIR/validation.md``, ``validation.json``). It first waits
for a quiet machine, with ``/tmp/BENCH_RUNNING`` created meanwhile. docs/planner.md, *Validation on this machine*.
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
from typing import Optional

from moe_plugin.planner.spec import ClusterSpec, Layout, PlanModel

BENCH_FLAG = Path("/tmp/BENCH_RUNNING")
WAIT_S = 300
VALIDATION_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, vocab_size=2048,
                        seq_length=128)
VALIDATION_MOE = dict(num_experts=8, router="gshard", capacity_factor=1.25, layer_interval=2)   # fp32: no bf16


def _lay(tp=1, pp=1, ep=1, etp=None, dp=1, mb=1, gas=1) -> Layout:
    return Layout(tp=tp, pp=pp, ep=ep, etp=tp if etp is None else etp, dp=dp, zero=1, micro_batch=mb, gas=gas)


# world size -> layouts (global batch 8 on 4 ranks, 16 on 8: 2 sequences per data-parallel rank and step)
LAYOUTS = {
    4: [_lay(dp=4, mb=2), _lay(ep=2, dp=4, mb=2), _lay(ep=4, dp=4, mb=2), _lay(tp=2, ep=2, etp=1, dp=2, mb=4),
        _lay(pp=2, ep=2, dp=2, mb=2, gas=2)],
    8: [_lay(dp=8, mb=2), _lay(ep=4, dp=8, mb=2), _lay(ep=8, dp=8, mb=2), _lay(tp=2, ep=4, etp=1, dp=4, mb=4),
        _lay(pp=2, ep=4, dp=4, mb=2, gas=2)],
}


def validation_model(world: int) -> PlanModel:
    return PlanModel.build({"train_batch_size": 2 * world, "moe": VALIDATION_MOE}, VALIDATION_SHAPE,
                           {"micro_batches": [1, 2, 4]})


def _ds_config(model: PlanModel, layout: Layout) -> dict:
    from moe_plugin.planner.search import ds_config

    config = ds_config(model, layout)
    config["optimizer"]["params"]["torch_adam"] = True      # DeepSpeed's FusedAdam would JIT-compile on CPU
    config["steps_per_print"] = 10 ** 9
    return config


def _provider(model: PlanModel, layout: Layout):
    def build(moe_config, groups):
        import torch
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(**model.shape.transformer_fields(), tensor_model_parallel_size=layout.tp,
                                   pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                   masked_softmax_fusion=False, apply_rope_fusion=False)
        if layout.pp > 1:
            from moe_plugin.integration.pipeline import gpt_pipeline_module

            return gpt_pipeline_module(config, moe_config, groups, vocab_size=model.shape.vocab_size,
                                       max_sequence_length=model.shape.seq_length, seed=0)
        from megatron.core.models.gpt import GPTModel

        from moe_plugin.integration.megatron import gpt_moe_spec

        torch.manual_seed(0)
        return GPTModel(config, gpt_moe_spec(moe_config, config, groups, seed=0, cpu=True),
                        vocab_size=model.shape.vocab_size, max_sequence_length=model.shape.seq_length)
    return build


def measure_layout(model: PlanModel, layout: Layout, rounds: int) -> list[float]:
    """Inside the ranks: build the engine for ``layout`` and time ``rounds`` steps (after one warm-up)."""
    import torch
    import torch.distributed as dist

    import moe_plugin

    result = moe_plugin.initialize(_ds_config(model, layout), _provider(model, layout))
    try:
        engine = result.engine
        dp_rank = result.groups.rank_in("dp")
        gen = torch.Generator().manual_seed(1000 + dp_rank)
        B, S = layout.micro_batch, model.shape.seq_length

        def micro():
            ids = torch.randint(0, model.shape.vocab_size, (B, S + 1), generator=gen)
            return ids[:, :-1].contiguous(), torch.arange(S).expand(B, S).contiguous(), ids[:, 1:].contiguous()

        def step() -> None:
            batches = [micro() for _ in range(layout.gas)]
            if layout.pp > 1:
                engine.train_batch(iter([((t, p), y) for t, p, y in batches]))
                return
            for tokens, positions, labels in batches:
                loss = engine(tokens, positions, None, labels=labels).float().mean()
                engine.backward(loss)
                engine.step()

        times = []
        for r in range(rounds + 1):
            dist.barrier()
            start = time.perf_counter()
            step()
            slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if r > 0:
                times.append(float(slowest))
        return times
    finally:
        result.close()


def _spawned(rank: int, world: int, model: PlanModel, layouts: list[Layout], rounds: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from moe_plugin.compat.process_exit import exit_process
    from moe_plugin.planner.calibrate import measure as calibrate_here
    from moe_plugin.planner.calibrate_pieces import measure_pieces

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    with contextlib.redirect_stdout(sys.stderr):   # DeepSpeed logs to stdout
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        try:
            before = {**calibrate_here(rank, world), "pieces": measure_pieces(rank, world)}
            out = {layout.name(): measure_layout(model, layout, rounds) for layout in layouts}
            after = {**calibrate_here(rank, world), "pieces": measure_pieces(rank, world)}
        finally:
            dist.destroy_process_group()
    (Path(tmp) / f"calibration{rank}.json").write_text(json.dumps([before, after]))
    if rank == 0:
        (Path(tmp) / "times.json").write_text(json.dumps(out))
    exit_process(0)   # not the interpreter's exit (compat/process_exit.py)


def measure(model: PlanModel, layouts: list[Layout], world: int, rounds: int
            ) -> tuple[dict[str, list[float]], dict, list[dict]]:
    """Every layout's step times, the cluster JSON of the calibrations before and after them, and their raw numbers."""
    import torch.multiprocessing as mp

    from moe_plugin.planner.calibrate import cluster_from

    with tempfile.TemporaryDirectory(prefix="moe_validate_") as tmp:
        mp.spawn(_spawned, args=(world, model, layouts, rounds, tmp), nprocs=world, join=True)
        pairs = [json.loads((Path(tmp) / f"calibration{r}.json").read_text()) for r in range(world)]
        times = json.loads((Path(tmp) / "times.json").read_text())
    measurements = [_mean(before, after) for before, after in pairs]
    return times, cluster_from(measurements, world), measurements


def _mean(a, b):
    """Mean of two calibrations (same keys; a GEMM point's FLOPs are kept)."""
    if isinstance(a, dict):
        return {k: ([[x[0], (x[1] + y[1]) / 2] for x, y in zip(a[k], b[k])] if k == "gemm" else _mean(a[k], b[k]))
                for k in a}
    if isinstance(a, list):
        return [_mean(x, y) for x, y in zip(a, b)]
    return (a + b) / 2


def wait_for_quiet(limit: float = 2.0, wait_s: float = WAIT_S) -> float:
    """Wait until the 1-minute load average is below ``limit`` (at most ``wait_s``); return it."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def validate(worlds: list[int], out: Path, calibration: Optional[Path], rounds: int) -> list[dict]:
    from moe_plugin.planner.cost_model import step_cost
    from moe_plugin.planner.report import markdown_table, text_table

    unknown = [w for w in worlds if w not in LAYOUTS]
    if unknown:
        raise ValueError(f"--ranks {unknown[0]}: the validation layouts are for {', '.join(map(str, LAYOUTS))} ranks")
    rows, records = [], []
    out.mkdir(parents=True, exist_ok=True)
    for world in worlds:
        BENCH_FLAG.touch()   # first: the others pause their heavy runs, so the load can fall
        try:
            load_before = wait_for_quiet()
            model = validation_model(world)
            measured, spec, raw = measure(model, LAYOUTS[world], world, rounds)
        finally:
            BENCH_FLAG.unlink(missing_ok=True)
        load_after = os.getloadavg()[0]
        (out / f"calibration_{world}ranks.json").write_text(json.dumps(spec, indent=2) + "\n")
        (out / f"calibration_{world}ranks.measurements.json").write_text(json.dumps(raw, indent=2) + "\n")
        cluster = ClusterSpec.load(calibration if calibration is not None else spec)
        for layout in LAYOUTS[world]:
            predicted = step_cost(model, cluster, layout).total
            times = measured[layout.name()]
            median = statistics.median(times)
            error = predicted / median - 1
            records.append({"ranks": world, "layout": layout.name(), "predicted_ms": 1e3 * predicted,
                            "measured_ms": 1e3 * median, "measured_rounds_ms": [1e3 * t for t in times],
                            "error": error, "load_before": load_before, "load_after": load_after})
            rows.append([str(world), layout.name(), f"{1e3 * predicted:.0f}", f"{1e3 * median:.0f}", f"{100 * error:+.1f}%"])
            print(" ".join(rows[-1]), f"(rounds {', '.join(f'{1e3 * t:.0f}' for t in times)} ms; load "
                  f"{load_before:.2f} before, {load_after:.2f} after)", file=sys.stderr, flush=True)
    mape = statistics.mean(abs(r["error"]) for r in records)
    head = ("ranks", "layout", "predicted_ms", "measured_ms", "error")
    loads = ", ".join(f"{r['ranks']} ranks: {r['load_before']:.2f} before, {r['load_after']:.2f} after"
                      for r in records[::len(LAYOUTS[worlds[0]])])
    print(text_table(head, rows))
    print(f"MAPE {100 * mape:.1f}% over {len(records)} layouts (load average {loads})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"mape": mape, "records": records}, indent=2) + "\n")
    (out / "validation.md").write_text(markdown_table(head, rows) + f"\n\nMAPE {100 * mape:.1f}% ({loads})\n")
    return records
