"""The cost of the guard's gradient hooks (``integration.guard.GradientWatch``) on a training step.

    python -m moe_plugin_tools.bench.guard_cost [--rounds 40] [--repeats 3] [--layers 4] [--hidden 256]

One process (1 gloo rank), the GPT-MoE of ``bench step`` (``gpt_models.build_ours``: what
``moe_plugin.initialize`` builds, the watch included), random tokens. The steps alternate, one
with the watch's hooks on, one with them removed (put back in front of DeepSpeed's own, where
``initialize`` put them), the same batch for both of a pair; per repeat the medians of wall and
CPU (this thread) time and the ratio, and the CPU time spent inside the watch itself (its hooks and
its check of the step, timed there: the alternation's ratio is within the noise of a shared machine). What it printed, with its date and commit: docs/long_runs.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _timed(hook, spent: list[float]):
    """``hook``, its CPU time (this thread's) added to ``spent[0]``."""
    def timed(param: torch.Tensor) -> None:
        began = time.thread_time()
        hook(param)
        spent[0] += time.thread_time() - began
    return timed


def _watch_on(watch, model: torch.nn.Module, spent: list[float]) -> None:
    """The watch's hooks back (timed into ``spent``), first on each parameter (before DeepSpeed's)."""
    params = [p for _n, p in model.named_parameters() if p.requires_grad]
    watch.handles = [p.register_post_accumulate_grad_hook(_timed(watch._hook(i), spent)) for i, p in enumerate(params)]
    for p, handle in zip(params, watch.handles):
        p._post_accumulate_grad_hooks.move_to_end(handle.id, last=False)


def measure(rounds: int, repeats: int, layers: int, hidden: int) -> list[dict]:
    from moe_plugin_tools.bench.gpt_models import GPTSpec, build_ours
    from moe_plugin_tools.bench.step import make_batches

    spec = GPTSpec(layers=layers, hidden=hidden, ffn=4 * hidden, ep=1)
    run = build_ours(spec, 1)
    engine, watch = run.engine, run.guard.watch
    batches = make_batches(spec, 4, 0)
    spent = [0.0]   # CPU seconds inside the watch's hooks and its check of the step
    out = []
    try:
        for repeat in range(repeats):
            times = {True: [], False: []}
            in_hooks = []
            for r in range(2 * (rounds + 2)):
                on = (r + repeat) % 2 == 0
                if on and not watch.handles:
                    _watch_on(watch, engine.module, spent)
                elif not on and watch.handles:
                    watch.remove()
                ids, pos, labels = batches[(r // 2) % len(batches)]
                spent[0] = 0.0
                wall, cpu = time.perf_counter(), time.thread_time()
                engine.backward(engine(ids, pos, None, labels=labels).float().mean())
                engine.step()
                if on:   # the step's check (GradientWatch.any_bad: collect and one isfinite), timed too
                    began = time.thread_time()
                    watch.any_bad()
                    spent[0] += time.thread_time() - began
                run.guard.after_step(r + 1)
                if r >= 4:   # two pairs of warm-up
                    times[on].append((time.perf_counter() - wall, time.thread_time() - cpu))
                    if on:
                        in_hooks.append(spent[0])
            row = {}
            for on, name in ((True, "with"), (False, "without")):
                row[f"{name}_wall_ms"] = 1e3 * statistics.median(t[0] for t in times[on])
                row[f"{name}_cpu_ms"] = 1e3 * statistics.median(t[1] for t in times[on])
            row["wall_ratio"] = row["with_wall_ms"] / row["without_wall_ms"]
            row["cpu_ratio"] = row["with_cpu_ms"] / row["without_cpu_ms"]
            row["hooks_cpu_ms"] = 1e3 * statistics.median(in_hooks)
            row["hooks_share"] = row["hooks_cpu_ms"] / row["with_cpu_ms"]
            out.append(row)
            print(f"repeat {repeat}: step with the watch {row['with_wall_ms']:.1f} ms wall / {row['with_cpu_ms']:.1f} "
                  f"ms CPU, without {row['without_wall_ms']:.1f} / {row['without_cpu_ms']:.1f}; ratio wall "
                  f"{row['wall_ratio']:.4f}, CPU {row['cpu_ratio']:.4f}; in the watch {row['hooks_cpu_ms']:.2f} ms CPU, "
                  f"{100 * row['hooks_share']:.2f}% of the step ({rounds} steps each)", flush=True)
    finally:
        if not watch.handles:
            _watch_on(watch, engine.module, spent)
        run.close()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed steps of each kind per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            measure(args.rounds, args.repeats, args.layers, args.hidden)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from moe_plugin.compat.process_exit import exit_process

    exit_process(0)   # not the interpreter's exit (moe_plugin/compat/process_exit.py)
