"""The python part of ``gpu_check.sh``: the MoE layer against the loop oracle, and ep2 against 1 rank.

    python examples/gpt_moe/gpu_check.py oracle [--device cuda]
    python -m torch.distributed.run --nproc_per_node 2 examples/gpt_moe/gpu_check.py ep2 [--device cuda]
    python examples/gpt_moe/gpu_check.py example OUT_DIR [--ranks 2]   # the example itself, a few steps
    python examples/gpt_moe/gpu_check.py recipe OUT_DIR [--ranks N]    # the GPU recipe's model, 20 steps, bf16
    python examples/gpt_moe/gpu_check.py collect OUT_DIR     # OUT_DIR/*.jsonl + *.status -> one JSON, a table

``oracle``: ``MoELayer`` on ``--device`` against ``reference_moe`` (fp32, on the CPU) with the same
weights, top-2, 8 experts, dropless and with capacity, for each experts backend that can run
there (``loop``, ``bmm``, ``grouped_mm`` where ``grouped_mm_unsupported`` finds no reason
against it, and ``auto``), fp32 and bf16 input (fp32 weights, cast in forward, as training under
DeepSpeed's bf16 sees them): the output and every gradient (input, router, experts). Tolerances:
fp32 atol = rtol = 1e-4 (TF32 off), bf16 atol 0.1, rtol 3e-2 (as tests/unit/layers/test_experts_backend.py).

``ep2``: every rank of a 2-rank job (gloo on the CPU, else the accelerator's backend: nccl)
runs the layer with EP = 2 on its own tokens and, in the same process, the 1-rank layer (same
seed) on each rank's tokens; with DeepSpeed's convention (dense gradients averaged over the
ranks, expert gradients as they are) output, input gradient and every gradient (expert shards
against their slice) agree within the same tolerances.

``example``: ``pretrain_gpt_moe.py`` itself, as a user runs it (``torch.distributed.run``, on the
accelerator DeepSpeed finds: the GPUs there), 8 steps of a tiny GPT-MoE (fp32, dropless deterministic top-2, the
stdlib corpus written to ``OUT_DIR/data``) on 1 rank and, with ``--ranks 2``, under tp2 x ep2,
tp2 x ep2 with sequence parallelism and dp2 x ep2: each run must exit 0 with finite losses, and
the 2-rank runs must give the 1-rank run's losses (rtol ``EXAMPLE_RTOL``). Each run's console
output is kept in ``OUT_DIR/<layout>.log``, its metrics in ``OUT_DIR/runs/<layout>``.

``recipe``: the example at the GPU recipe's size and dtype (``run_gpu_125m.sh``: 12 layers, hidden 768,
12 heads, sequence 1024, micro-batch 8, 8 experts top-2 on every other layer, bf16, ZeRO-1,
``configs/gpu_125m_8experts_8gpu.json`` with expert parallelism over the ranks at hand) for
``RECIPE_STEPS`` steps on ``--ranks`` GPUs: tokens/s and step time (median of the steps after the first
five), MFU against the device's dense bf16 peak (``PEAK_BF16``; model FLOPs per token 6 x active
parameters + 12 x layers x hidden x sequence), and the run summary's memory estimate against the peak
``torch.cuda.max_memory_allocated`` of the busiest rank (``memory.json``). ``--tiny``: the same on a small
model (a dry run on the CPU).

Each check prints one JSON line per case (``ok``, the largest differences, the backend taken)
and exits 1 when a case fails; ``collect`` merges a run directory into ``gpu_check.json`` and prints
a table of the checks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_plugin.configs import MoEConfig
from moe_plugin.layers import MoELayer, reference_moe
from moe_plugin.layers.expert_backend import grouped_mm_unsupported

S, B, H, F, E = 8, 4, 16, 32, 8   # the sizes of tests/unit/layers/test_layers_single.py, where these tolerances hold
TOLERANCE = {"fp32": dict(atol=1e-4, rtol=1e-4), "bf16": dict(atol=1e-1, rtol=3e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = {"dropless": dict(drop_tokens=False), "capacity": dict(drop_tokens=True, capacity_factor=1.0, min_capacity=1)}


def moe_config(case: str, backend: str, ep: int = 1) -> MoEConfig:
    return MoEConfig.from_dict({"num_experts": E, "router": "topk", "top_k": 2,
                                "activation": "gelu", "aux_loss_coeff": 0.1, "experts_backend": backend,
                                "parallel": {"expert": ep}, **CASES[case]})


def inputs(seed: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_SBH = torch.randn(S, B, H, generator=gen)
    return x_SBH.to(device, dtype).requires_grad_(True), torch.randn(S, B, H, generator=gen).to(device)


def train_step(layer: MoELayer, x_SBH: torch.Tensor, grad_SBH: torch.Tensor) -> torch.Tensor:
    out_SBH, _ = layer(x_SBH)
    (out_SBH.float() * grad_SBH).sum().backward()
    return out_SBH.detach()


def max_diff(a: torch.Tensor, b: torch.Tensor, tol: dict) -> tuple[float, bool]:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max()), bool(torch.allclose(a, b, **tol))


def backends(device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """The backends to check here, and the skipped ones with why."""
    why_not = grouped_mm_unsupported(device, dtype, (H, F, F))
    runnable = ["loop", "bmm"] + ([] if why_not else ["grouped_mm"]) + ["auto"]
    return runnable, ({"grouped_mm": why_not} if why_not else {})


def oracle_case(case: str, backend: str, device: torch.device, dtype_name: str) -> dict:
    """One layer-vs-oracle comparison (module docstring); the JSON line."""
    dtype, tol = DTYPES[dtype_name], TOLERANCE[dtype_name]
    layer = MoELayer(moe_config(case, backend), H, F, seed=0, init_std=0.3).to(device).train()
    x_SBH, grad_SBH = inputs(1, device, dtype)
    out_SBH = train_step(layer, x_SBH, grad_SBH)
    params = {n: p.detach().cpu().float().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    params["router.expert_bias"] = layer.router.expert_bias.detach().cpu().float()
    x_ref = x_SBH.detach().cpu().float().reshape(S * B, H).requires_grad_(True)
    ref = reference_moe(x_ref, params, layer.config, training=True)
    ((ref.out * grad_SBH.cpu().reshape(S * B, H)).sum() + ref.weighted_aux_loss(layer.config)).backward()
    diffs = {"out": max_diff(out_SBH.reshape(S * B, H), ref.out, tol),
             "x_grad": max_diff(x_SBH.grad.reshape(S * B, H), x_ref.grad, tol)}
    diffs.update({f"{n}_grad": max_diff(p.grad, params[n].grad, tol) for n, p in layer.named_parameters()})
    same_routes = layer.last_stats.kept_per_expert.tolist() == ref.kept_per_expert
    return {"check": "oracle", "device": str(device), "dtype": dtype_name, "case": case, "backend": backend,
            "ran": layer.experts.pick_backend(x_SBH), "ok": same_routes and all(ok for _, ok in diffs.values()),
            "same_routes": same_routes, "max_abs_diff": {k: d for k, (d, _) in diffs.items()}, "tolerance": tol}


def run_oracle(device: torch.device) -> bool:
    ok = True
    for dtype_name in DTYPES:
        runnable, skipped = backends(device, DTYPES[dtype_name])
        for backend, why in skipped.items():
            print(json.dumps({"check": "oracle", "device": str(device), "dtype": dtype_name, "backend": backend,
                              "skipped": why}), flush=True)
        for case in CASES:
            for backend in runnable:
                record = oracle_case(case, backend, device, dtype_name)
                ok &= record["ok"]
                print(json.dumps(record), flush=True)
    return ok


def ep2_case(case: str, device: torch.device, dtype_name: str, groups) -> dict:
    """EP = world ranks against the 1-rank layer on every rank's tokens (module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, tol = DTYPES[dtype_name], TOLERANCE[dtype_name]
    layer = MoELayer(moe_config(case, "auto", world), H, F, groups, seed=0, init_std=0.3).to(device).train()
    x_SBH, grad_SBH = inputs(100 + rank, device, dtype)
    out_SBH = train_step(layer, x_SBH, grad_SBH)
    single = MoELayer(moe_config(case, "auto"), H, F, seed=0, init_std=0.3).to(device).train()
    for r in range(world):   # every rank's tokens, gradients summed
        x_r, grad_r = inputs(100 + r, device, dtype)
        out_r = train_step(single, x_r, grad_r)
        if r == rank:
            diffs = {"out": max_diff(out_SBH, out_r, tol), "x_grad": max_diff(x_SBH.grad, x_r.grad, tol)}
    local = len(layer.experts.weight1)
    for name, p in layer.named_parameters():
        grad = p.grad.detach().clone()
        if getattr(p, "allreduce", True):   # dense: DeepSpeed averages over the data-parallel ranks
            dist.all_reduce(grad)
            grad /= world
        full = dict(single.named_parameters())[name].grad / world
        if not getattr(p, "allreduce", True):
            full = full[rank * local:(rank + 1) * local]
        diffs[f"{name}_grad"] = max_diff(grad, full, tol)
    flags = torch.tensor([float(not all(ok for _, ok in diffs.values()))] + [d for d, _ in diffs.values()],
                         device=device)   # nccl reduces device tensors only
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)   # the job's verdict and largest differences
    return {"check": "ep2", "device": device.type, "dtype": dtype_name, "case": case, "ranks": world,
            "backend": dist.get_backend(), "ok": flags[0].item() == 0, "tolerance": tol,
            "max_abs_diff": dict(zip(diffs, flags[1:].tolist()))}


def run_ep2(device_type: str) -> bool:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.layout import RankLayout

    backend = "gloo"
    if device_type != "cpu":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
        backend = get_accelerator().communication_backend_name()
    dist.init_process_group(backend)
    device = torch.device(device_type, int(os.environ["LOCAL_RANK"])) if device_type != "cpu" else torch.device("cpu")
    groups = build_process_groups(RankLayout.build(dist.get_world_size(), ep=dist.get_world_size()), backend=backend)
    ok = True
    try:
        for dtype_name in DTYPES:
            for case in CASES:
                record = ep2_case(case, device, dtype_name, groups)
                ok &= record["ok"]
                if dist.get_rank() == 0:
                    print(json.dumps(record), flush=True)
    finally:
        destroy_process_groups(groups)
        dist.destroy_process_group()
    return ok


EXAMPLE = Path(__file__).resolve().parent / "pretrain_gpt_moe.py"
EXAMPLE_STEPS = 8
EXAMPLE_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
                 "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", str(EXAMPLE_STEPS),
                 "--eval-interval", "4", "--eval-iters", "1", "--log-interval", "4", "--seed", "7",
                 "--corpus-bytes", str(192 * 1024), "--valid-fraction", "0.25"]
# deterministic top-2 (GShard's 2nd expert always kept), dropless: the same routes under every layout
EXAMPLE_MOE = {"num_experts": 4, "router": "gshard", "second_expert_policy": "all", "drop_tokens": False,
               "aux_loss_coeff": 0.01, "layer_interval": 1}
# name -> ranks, moe.parallel: one model under each layout (global batch 8 of micro-batches of 2)
EXAMPLE_LAYOUTS = {"1rank": (1, {}),
                   "tp2-ep2": (2, {"tensor": 2, "expert": 2, "expert_tensor": 1}),
                   "tp2sp-ep2": (2, {"tensor": 2, "expert": 2, "expert_tensor": 1, "sequence_parallel": True}),
                   "dp2-ep2": (2, {"expert": 2})}
EXAMPLE_RTOL = 1e-3   # fp32; reductions in another order per layout


def example_config(path: Path, ranks: int, parallel: dict) -> Path:
    """The DeepSpeed JSON of one layout: global batch 8, micro-batches of 2, ZeRO-1, the optimizer of
    ``configs/tiny_cpu_4rank.json`` (AdamW warmed up over 20 steps; torch's Adam: no CUDA op to build)."""
    dp = ranks // parallel.get("tensor", 1)
    path.write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // dp,
        "gradient_clipping": 1.0, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-08,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002,
                                                     "warmup_num_steps": 20}},
        "moe": {**EXAMPLE_MOE, "parallel": parallel}}))
    return path


def compare_losses(losses: list, reference: list | None) -> tuple[bool, float | None]:
    """Finite, one per step, and (given a reference run) equal to it within ``EXAMPLE_RTOL``."""
    ok = len(losses) == EXAMPLE_STEPS and all(math.isfinite(x) for x in losses)
    if reference is None or not ok:
        return ok, None
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
    return worst <= EXAMPLE_RTOL, worst


def example_run(out_dir: Path, name: str, ranks: int, parallel: dict, reference: list | None) -> dict:
    """One layout through the example (module docstring); its JSON record."""
    root = EXAMPLE.parents[2]
    run_dir = out_dir / "runs" / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(EXAMPLE), *EXAMPLE_FLAGS, "--deepspeed_config", str(example_config(out_dir / f"{name}.json", ranks,
                                                                                     parallel)),
               "--run-dir", str(run_dir), "--data-cache", str(out_dir / "data")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    log = out_dir / f"{name}.log"
    with open(log, "w") as console:
        done = subprocess.run(command, cwd=root, env=env, stdout=console, stderr=subprocess.STDOUT, timeout=1800)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    same, worst = compare_losses(losses, reference)
    record = {"check": "example", "layout": name, "ranks": ranks, "parallel": parallel, "exit_code": done.returncode,
              "ok": done.returncode == 0 and same, "losses": losses, "reference": "1rank" if reference else None,
              "max_rel_diff": worst, "rtol": EXAMPLE_RTOL, "log": str(log)}
    if done.returncode != 0:
        record["error"] = first_error(log.read_text())
    return record


RECIPE_STEPS = 20
RECIPE_FLAGS = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--ffn-hidden-size",
                "3072", "--seq-length", "1024", "--max-position-embeddings", "1024"]
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--ffn-hidden-size", "128",
              "--seq-length", "64", "--corpus-bytes", str(512 * 1024)]
RECIPE_CONFIG = EXAMPLE.parent / "configs" / "gpu_125m_8experts_8gpu.json"
# dense bf16 tensor-core peak per device (FLOP/s), by a name the device's contains (SXM parts)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def recipe_config(path: Path, ranks: int, micro: int) -> Path:
    """The GPU recipe's JSON on ``ranks`` ranks: expert parallelism over as many of them as divide its 8
    experts, one micro-batch per rank and step."""
    config = json.loads(RECIPE_CONFIG.read_text())
    ep = max(d for d in (1, 2, 4, 8) if ranks % d == 0)
    config.update(train_batch_size=micro * ranks, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1)
    config["moe"]["parallel"] = {**config["moe"]["parallel"], "expert": ep}
    path.write_text(json.dumps(config))
    return path


def run_recipe(out_dir: Path, ranks: int, tiny: bool = False) -> bool:
    """The ``recipe`` check (module docstring): one JSON line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    root, run_dir = EXAMPLE.parents[2], out_dir / "run"
    micro = 2 if tiny else 8
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(EXAMPLE), *(TINY_FLAGS if tiny else RECIPE_FLAGS), "--micro-batch-size", str(micro),
               "--deepspeed_config", str(recipe_config(out_dir / "recipe.json", ranks, micro)),
               "--train-iters", str(RECIPE_STEPS), "--eval-interval", "0", "--log-interval", "1", "--no-plot",
               "--run-dir", str(run_dir), "--data-cache", str(out_dir / "data")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    log = out_dir / "recipe.log"
    with open(log, "w") as console:
        done = subprocess.run(command, cwd=root, env=env, stdout=console, stderr=subprocess.STDOUT, timeout=1800)
    record = {"check": "recipe", "ranks": ranks, "tiny": tiny, "exit_code": done.returncode, "log": str(log)}
    if done.returncode != 0:
        print(json.dumps({**record, "ok": False, "error": first_error(log.read_text())}), flush=True)
        return False
    record.update(recipe_figures(run_dir, ranks))
    record["ok"] = len(record["losses"]) == RECIPE_STEPS and all(math.isfinite(x) for x in record["losses"])
    print(json.dumps(record), flush=True)
    return record["ok"]


def recipe_figures(run_dir: Path, ranks: int) -> dict:
    """Throughput, MFU and memory of a finished run (its metrics.jsonl, run.json, memory.json)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    run = json.loads((run_dir / "run.json").read_text())
    memory = json.loads((run_dir / "memory.json").read_text())
    steady = train[5:] or train
    rates = sorted(r["tokens_per_s"] for r in steady if r.get("tokens_per_s"))
    tokens_per_s = rates[len(rates) // 2] if rates else None
    times = sorted(r["step_s"] for r in steady if r.get("step_s"))
    args = run["args"]
    tokens_per_step = run["ds_config"]["train_batch_size"] * args["seq_length"]
    attention = 12 * args["num_layers"] * args["hidden_size"] * args["seq_length"]
    flops_per_token = 6 * run["parameters"]["active"] + attention
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    mfu = tokens_per_s * flops_per_token / (ranks * peak) if peak and tokens_per_s else None
    used = max(memory["peak_memory_mb"])
    return {"losses": [r["loss"] for r in train], "device": device, "tokens_per_s": tokens_per_s,
            "step_time_s": times[len(times) // 2] if times else tokens_per_step / tokens_per_s,
            "flops_per_token": flops_per_token, "peak_bf16_flops": peak, "mfu": mfu,
            "memory_peak_mb": used, "memory_estimate_mb": memory["estimate_mb"],
            "memory_peak_over_estimate": used / memory["estimate_mb"]}


def first_error(console: str) -> str:
    """The example's one-line error (``error: ...``), else the first exception a traceback ends in,
    else the last lines of the console."""
    lines = [line.strip() for line in console.splitlines() if line.strip()]
    for pattern in (r"^error: ", r"^[\w.]*(Error|Exception)\b[^:]*: "):
        found = [line for line in lines if re.match(pattern, line)]
        if found:
            return found[0]
    return " | ".join(lines[-3:])


def run_example(out_dir: Path, max_ranks: int) -> bool:
    """Every ``EXAMPLE_LAYOUTS`` entry that fits in ``max_ranks``; the 2-rank ones against the 1-rank run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ok, reference = True, None
    for name, (ranks, parallel) in EXAMPLE_LAYOUTS.items():
        if ranks > max_ranks:
            print(json.dumps({"check": "example", "layout": name, "ranks": ranks,
                              "skipped": f"needs {ranks} ranks, --ranks {max_ranks}"}), flush=True)
            continue
        record = example_run(out_dir, name, ranks, parallel, reference if ranks > 1 else None)
        if ranks == 1 and record["ok"]:
            reference = record["losses"]
        ok &= record["ok"]
        print(json.dumps(record), flush=True)
    return ok


def collect(out_dir: Path) -> bool:
    """``gpu_check.json``: the machine, and per check its status and JSON lines (module docstring)."""
    checks = {}
    for status in sorted(out_dir.glob("*.status")):
        name, text = status.stem, status.read_text().strip()
        lines = out_dir / f"{name}.jsonl"
        records = [json.loads(l) for l in lines.read_text().splitlines() if l.startswith("{")] if lines.exists() else []
        checks[name] = {"status": "skipped" if text.startswith("skip") else "ok" if text == "0" else "failed",
                        "exit_code": int(text) if text.lstrip("-").isdigit() else None,
                        "note": text if text.startswith("skip") else None, "records": records}
    result = {"machine": {"host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
                          "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
              "ok": all(c["status"] != "failed" for c in checks.values()), "checks": checks}
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(path)
    return result["ok"]


def table(result: dict) -> str:
    """The checks as a printed table: status and the figures people read first."""
    rows = [f"{'check':<16} {'status':<8} figures", "-" * 72]
    for name, check in result["checks"].items():
        figures = check["note"] or ""
        for r in check["records"]:
            if name == "recipe" and r.get("ok"):
                mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
                figures = (f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_time_s']:.3f} s{mfu}, memory "
                           f"{r['memory_peak_mb']:,.0f} / estimate {r['memory_estimate_mb']:,.0f} MiB "
                           f"({r['memory_peak_over_estimate']:.2f}x)")
        if not figures and check["records"]:
            bad = [r for r in check["records"] if not r.get("ok", True)]
            figures = f"{len(check['records']) - len(bad)} of {len(check['records'])} cases ok" + (
                f"; first failure: {bad[0].get('error') or bad[0].get('case') or bad[0].get('layout')}" if bad else "")
        rows.append(f"{name:<16} {check['status']:<8} {figures}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["oracle", "ep2", "example", "recipe", "collect"])
    parser.add_argument("out_dir", nargs="?", type=Path, help="collect: the run directory; example: where it runs")
    parser.add_argument("--device", default="cuda", help="default cuda (cpu: the same checks, for a dry run); "
                        "example: the accelerator DeepSpeed finds")
    parser.add_argument("--ranks", type=int, default=1, help="example: the most ranks (GPUs) a layout may take; "
                        "recipe: the ranks")
    parser.add_argument("--tiny", action="store_true", help="recipe: a small model (a dry run on the CPU)")
    args = parser.parse_args(argv)
    if args.check == "recipe":
        if args.out_dir is None:
            parser.error("recipe needs OUT_DIR")
        return 0 if run_recipe(args.out_dir, args.ranks, args.tiny) else 1
    if args.check == "collect":
        return 0 if collect(args.out_dir) else 1
    if args.check == "example":
        if args.out_dir is None:
            parser.error("example needs OUT_DIR")
        return 0 if run_example(args.out_dir, args.ranks) else 1
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            print(f"error: --device {args.device}: torch finds no CUDA device", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False   # fp32 tolerances are for fp32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    ok = run_oracle(torch.device(args.device)) if args.check == "oracle" else run_ep2(torch.device(args.device).type)
    return 0 if ok else 1


if __name__ == "__main__":
    from moe_plugin import run_and_exit

    run_and_exit(main)   # not sys.exit: see moe_plugin/compat/process_exit.py
