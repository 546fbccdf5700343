"""Static vs load-adaptive (greedy) expert placement on a skewed GPT-MoE: two runs, one command.

    .venv/bin/python examples/gpt_moe/placement_experiment.py             # 2 CPU ranks, ep 2, ~2 minutes
    .venv/bin/python examples/gpt_moe/placement_experiment.py --profile   # + per-rank phase times
    .venv/bin/python examples/gpt_moe/placement_experiment.py --world-size 4 --ep 4 --micro-batch-size 16

Both runs train the same GPT-MoE (``pretrain_gpt_moe.py`` under the ``deepspeed`` launcher, same
seed, same data, same skewed router: ``--router-skew``, a Zipf-like load on experts 0, 1, 2, ...)
back to back; they differ only in ``moe.placement`` (the policy, and for greedy its check settings):
``static`` (expert e on EP rank ``e // (E / EP)``, so the hot experts share rank 0) and ``greedy``
(every ``--check-interval`` steps the controller may migrate experts, ``integration/placement.py``).
Both write a gate trace.
The sizes make the experts' GEMMs most of a step on CPU (top-1 dropless routing, FFN 16 x
hidden, one layer, MoE, 8 experts per rank, 4,096 tokens per rank and step: measured, the
busiest rank spends ~70 % of a static step in its experts). The defaults are 2 ranks of one
thread on a 2-core machine: every rank has a core of its own, so the busiest rank sets the
step. With more single-threaded ranks than cores (4 ranks on 2 cores) a rank that waits in the
all-to-all gives its core to a busy one, the total CPU work (the same under both placements)
sets the pace, and the balance shows in the imbalance, hardly in the step time.

Keeping the load skewed but not collapsed took three choices (measured, see docs/benchmarks_history.md):
top-1 routing with the gate renormalised to 1 (``topk``, k 1: no gradient through the gate
value, which otherwise pulls the hidden states towards the busiest expert within ~10 steps),
frozen router weights (``--freeze-router``; no balance loss, which would train the skew away)
and a small learning rate (the LM objective still drifts the hidden states towards a few
experts). The load then drifts slowly, which the dynamic run follows by switching again.

Figures (one JSON line on stdout, also ``<out>/result.json``):

* ``imbalance_static`` / ``imbalance_dynamic``: max over EP ranks / mean of the routes the ranks'
  experts processed, per step from the gate trace and the placement in effect at that step (the
  switches in ``placement.jsonl``), mean over MoE layers, then over the steps from the first
  check on (the same steps in both runs; ``*_all_steps`` over every step);
* ``step_ms_static`` / ``step_ms_dynamic``: mean wall time of a training step on rank 0 after
  ``--warmup`` steps, the controller's checks and migrations included (``step_s`` in
  ``metrics.jsonl``); ``speedup`` their ratio; ``step_ms_median_*`` the medians (less
  sensitive to other processes on a shared machine);
* ``migrations`` (switch events), ``migration_ms`` (rank 0's measured time in ``migrate``),
  ``loadavg`` (1-minute load average before and after);
* with ``--profile``, ``profile``: per run and rank the median over the steps after ``--warmup``
  of the step's phases in wall ms (``profiled_rank``): ``step``, ``forward``,
  ``backward_optimizer``, ``moe_forward`` / ``moe_backward`` (the MoE layers, all-to-alls
  included), ``all_to_all`` (time inside the row exchanges: waiting for the other ranks plus
  moving rows), ``expert_compute`` (MoE minus all-to-all) and ``cpu`` (the process's CPU ms,
  10 ms clock ticks);
* the plot ``<out>/placement_experiment.png``: per-expert load share over steps (dynamic run,
  first MoE layer, switches marked), rank imbalance over steps for both runs, step time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/placement_experiment", help="both runs and the plot go here")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks (processes) of each run; more than the cores hides the imbalance (module docstring)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1, help="every layer is an MoE layer")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=2048, help="each expert's FFN")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=32, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--skew", type=float, default=0.35, help="--router-skew of both runs (Zipf-like exponent)")
    p.add_argument("--aux-loss-coeff", type=float, default=0.0,
                   help="GShard balance loss (it would train the skew away; the routers are frozen anyway)")
    p.add_argument("--lr", type=float, default=3e-5,
                   help="small: the LM objective drifts the hidden states, and so the load, towards a few experts")
    p.add_argument("--check-interval", type=int, default=4, help="steps between placement checks (dynamic run)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step time")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--policies", default="static,greedy", help="which runs to train (the analysis needs both)")
    p.add_argument("--only-analyse", action="store_true", help="do not train; analyse the runs already in --out")
    p.add_argument("--profile", action="store_true",
                   help="also time every rank's step phases, MoE layers and all-to-alls (profile_<policy>.json)")
    return p.parse_args(argv)


def ds_config(args: argparse.Namespace, policy: str) -> dict:
    return {
        "train_batch_size": args.micro_batch_size * args.world_size,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1},
        "moe": {"num_experts": args.num_experts, "router": "topk", "top_k": 1, "drop_tokens": False,
                "aux_loss_coeff": args.aux_loss_coeff,
                "layer_interval": 1, "parallel": {"expert": args.ep},
                "placement": placement_block(args, policy)},
    }


def placement_block(args: argparse.Namespace, policy: str) -> dict:
    """The runs' ``moe.placement``: the policy, a trace, and the check settings where the policy reads them."""
    block = {"policy": policy, "trace_file": "gate.trace"}
    if policy != "static":
        block.update(check_interval=args.check_interval, window=args.check_interval, min_gain=0.05)
    return block


def free_port() -> int:
    """A TCP port nobody listens on now (other jobs on the machine may hold the launcher's 29500)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(args: argparse.Namespace, policy: str) -> Path:
    """One run under the deepspeed launcher; returns its run directory."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{policy}.json"
    config.write_text(json.dumps(ds_config(args, policy), indent=2) + "\n")
    run_dir = out / policy
    for stale in (out / f"profile_{policy}").glob("rank*.jsonl"):   # an older run's profile
        stale.unlink()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    entry = [str(Path(__file__).resolve()), PROFILE_FLAG, str(out / f"profile_{policy}")] if args.profile else \
        [str(HERE / "pretrain_gpt_moe.py")]
    command = [str(bin_dir / "deepspeed"), "--num_gpus", str(args.world_size), "--master_port", str(free_port()),
               *entry,
               "--deepspeed_config", str(config), "--run-dir", str(run_dir),
               "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
               "--num-attention-heads", "2", "--ffn-hidden-size", str(args.ffn_hidden_size),
               "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
               "--train-iters", str(args.steps), "--eval-interval", "0", "--eval-iters", "1",
               "--log-interval", str(args.check_interval), "--seed", str(args.seed),
               "--router-skew", str(args.skew), "--freeze-router"]
    print(f"== {policy}: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env=env)
    return run_dir


# --- analysis -------------------------------------------------------------------------------------
def placements_by_step(log: list[dict], steps: int) -> dict[str, np.ndarray]:
    """{trace layer name: [steps, E] the slot of each expert during each step}. A switch logged at
    step k happens after step k's forwards, so it is in effect from step k + 1."""
    start = log[0]
    names = start["layers"]   # module name -> trace name
    out = {names[m]: np.tile(np.asarray(p), (steps, 1)) for m, p in start["placements"].items()}
    for record in log:
        if record["event"] == "check" and record.get("switch"):
            out[names[record["layer"]]][record["step"] + 1:] = np.asarray(record["placement"])
    return out


def rank_imbalance(trace, placements: dict[str, np.ndarray]) -> np.ndarray:
    """[steps] max / mean of the routes per EP rank, mean over layers."""
    kept = trace.kept()                                # [steps, layers, E]
    L = trace.num_experts // trace.ep_size
    per_layer = []
    for i, name in enumerate(trace.layers):
        ranks = placements[name][trace.steps] // L      # [steps, E]
        loads = np.zeros((kept.shape[0], trace.ep_size))
        for s in range(kept.shape[0]):
            np.add.at(loads[s], ranks[s], kept[s, i])
        per_layer.append(loads.max(1) / np.maximum(loads.mean(1), 1e-9))
    return np.mean(per_layer, axis=0)


def analyse(run_dir: Path) -> dict:
    from moe_plugin.integration.placement import read_placement_log
    from moe_plugin.placement import read_trace

    trace = read_trace(run_dir / "gate.trace")
    log = read_placement_log(run_dir / "placement.jsonl")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r["split"] == "train"]
    steps = int(trace.steps.max()) + 1
    switches = [r for r in log if r["event"] == "switch"]
    return {"trace": trace, "log": log, "imbalance": rank_imbalance(trace, placements_by_step(log, steps)),
            "step_s": np.asarray([r["step_s"] for r in train]), "loss": np.asarray([r["loss"] for r in train]),
            "switch_steps": [r["step"] for r in switches],
            "migration_s": sum(r.get("measured_migration_seconds") or 0.0 for r in switches)}


def figures(args: argparse.Namespace, static: dict, dynamic: dict, loadavg: list[float]) -> dict:
    first_check = args.check_interval   # steps [first_check, steps) run with the placement chosen at the check
    w = args.warmup

    def r(x: float, digits: int = 3) -> float:
        return round(float(x), digits)

    step_static, step_dynamic = static["step_s"][w:].mean(), dynamic["step_s"][w:].mean()
    return {"imbalance_static": r(static["imbalance"][first_check:].mean()),
            "imbalance_dynamic": r(dynamic["imbalance"][first_check:].mean()),
            "imbalance_static_all_steps": r(static["imbalance"].mean()),
            "imbalance_dynamic_all_steps": r(dynamic["imbalance"].mean()),
            "step_ms_static": r(1e3 * step_static, 1), "step_ms_dynamic": r(1e3 * step_dynamic, 1),
            "step_ms_median_static": r(1e3 * np.median(static["step_s"][w:]), 1),
            "step_ms_median_dynamic": r(1e3 * np.median(dynamic["step_s"][w:]), 1),
            "speedup": r(step_static / step_dynamic), "migrations": len(dynamic["switch_steps"]),
            "switch_steps": [s + 1 for s in dynamic["switch_steps"]],
            "migration_ms": r(1e3 * dynamic["migration_s"], 1),
            "final_loss_static": r(static["loss"][-1], 4), "final_loss_dynamic": r(dynamic["loss"][-1], 4),
            "loadavg": [r(x, 2) for x in loadavg],
            "sizes": {"world_size": args.world_size, "ep": args.ep, "experts": args.num_experts,
                      "layers": args.num_layers, "hidden": args.hidden_size, "ffn": args.ffn_hidden_size,
                      "tokens_per_rank": args.micro_batch_size * args.seq_length, "steps": args.steps,
                      "skew": args.skew, "check_interval": args.check_interval, "warmup": w}}


def plot(path: Path, static: dict, dynamic: dict, result: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = dynamic["trace"]
    kept = trace.kept()[:, 0, :].astype(float)                      # [steps, E] first MoE layer
    share = kept / np.maximum(kept.sum(1, keepdims=True), 1)
    steps = trace.steps + 1
    fig, (ax_heat, ax_imb, ax_time) = plt.subplots(3, 1, figsize=(9, 10), sharex=True,
                                                   gridspec_kw={"height_ratios": [1.3, 1, 1]})
    image = ax_heat.imshow(share.T, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                           extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, share.shape[1] - 0.5))
    colorbar_ax = ax_heat.inset_axes([1.01, 0.0, 0.015, 1.0])   # keeps the step axis aligned with the others
    fig.colorbar(image, cax=colorbar_ax, label="share of routes")
    ax_heat.set_ylabel("expert id")
    per_rank = trace.num_experts // trace.ep_size
    ax_heat.set_title(f"per-expert load of {trace.layers[0]}, greedy run (router skew {result['sizes']['skew']}: "
                      f"low ids hot; static puts experts 0-{per_rank - 1} on rank 0)", fontsize=10)
    for ax in (ax_heat, ax_imb, ax_time):
        for i, s in enumerate(dynamic["switch_steps"]):
            ax.axvline(s + 1.5, color="red", ls="--", lw=1, label="greedy switch (migration)" if i == 0 else None)
    ax_imb.plot(steps, static["imbalance"], "o-", ms=3, color="tab:gray", label="static placement")
    ax_imb.plot(steps, dynamic["imbalance"], "o-", ms=3, color="tab:blue", label="greedy placement")
    ax_imb.axhline(1.0, color="black", lw=0.6, ls=":")
    ax_imb.set_ylabel("rank imbalance\n(max / mean routes per EP rank)")
    ax_imb.legend(loc="upper right")
    ax_imb.grid(alpha=0.3)
    ax_time.plot(np.arange(1, len(static["step_s"]) + 1), 1e3 * static["step_s"], "o-", ms=3, color="tab:gray",
                 label=f"static, mean {result['step_ms_static']:.0f} ms")
    ax_time.plot(np.arange(1, len(dynamic["step_s"]) + 1), 1e3 * dynamic["step_s"], "o-", ms=3, color="tab:blue",
                 label=f"greedy, mean {result['step_ms_dynamic']:.0f} ms (migrations included)")
    ax_time.set_ylabel("step time (ms, rank 0)")
    ax_time.set_xlabel("step")
    ax_time.legend(loc="upper right")
    ax_time.grid(alpha=0.3)
    fig.suptitle(f"static vs greedy expert placement: {result['sizes']['world_size']} ranks, ep "
                 f"{result['sizes']['ep']}, {result['sizes']['experts']} experts, load avg {result['loadavg'][0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- per-rank profile (--profile) ------------------------------------------------------------------
PROFILE_FLAG = "--rank-profile"


def profiled_rank(profile_dir: Path, argv: list[str]) -> int:
    """One rank of a ``--profile`` run: ``pretrain_gpt_moe.main(argv)`` with timers around its
    ``micro_batch_loss`` (the forward), its ``train_step`` (the whole step without the placement
    check) and every row all-to-all of the MoE layers (``comm._all_to_all``: the dispatch and
    combine exchanges, forward and backward), plus ``bench.step.MoETimer`` hooks on the MoE layers.
    Writes ``<profile_dir>/rank<r>.jsonl``: per step, wall ms of ``step``, ``forward``,
    ``backward_optimizer`` (step - forward), ``moe_forward``, ``moe_backward``, ``all_to_all``
    (time inside the exchanges: waiting for the slowest rank plus moving rows), ``expert_compute``
    (MoE forward + backward - all_to_all: routing, gathers, expert GEMMs), ``cpu`` (process CPU ms)."""
    import time

    import pretrain_gpt_moe as pretrain

    from moe_plugin_tools.bench.step import MoETimer
    from moe_plugin.layers import MoELayer, comm

    rank = int(os.environ.get("RANK", "0"))
    profile_dir.mkdir(parents=True, exist_ok=True)
    records, state = [], {"timer": None, "a2a": 0.0, "forward": 0.0}
    exchange, forward, train_step = comm._all_to_all, pretrain.micro_batch_loss, pretrain.train_step

    def timed_exchange(*a, **k):
        began = time.perf_counter()
        try:
            return exchange(*a, **k)
        finally:
            state["a2a"] += time.perf_counter() - began

    def timed_forward(engine, *a, **k):
        began = time.perf_counter()
        try:
            return forward(engine, *a, **k)
        finally:
            state["forward"] += time.perf_counter() - began

    def timed_step(run, data, plan, step):
        if state["timer"] is None:
            state["timer"] = MoETimer([m for m in run.engine.module.modules() if isinstance(m, MoELayer)])
        timer = state["timer"]
        timer.reset()
        state.update(a2a=0.0, forward=0.0)
        cpu, began = os.times(), time.perf_counter()
        loss = train_step(run, data, plan, step)
        wall, cpu_after = time.perf_counter() - began, os.times()
        moe = timer.forward[0] + timer.backward[0]
        records.append({"step": step + 1, "step_ms": 1e3 * wall, "forward_ms": 1e3 * state["forward"],
                        "backward_optimizer_ms": 1e3 * (wall - state["forward"]),
                        "moe_forward_ms": 1e3 * timer.forward[0], "moe_backward_ms": 1e3 * timer.backward[0],
                        "all_to_all_ms": 1e3 * state["a2a"], "expert_compute_ms": 1e3 * (moe - state["a2a"]),
                        "cpu_ms": 1e3 * ((cpu_after.user + cpu_after.system) - (cpu.user + cpu.system))})
        return loss

    comm._all_to_all, pretrain.micro_batch_loss, pretrain.train_step = timed_exchange, timed_forward, timed_step
    try:
        return pretrain.main(argv)
    finally:
        (profile_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def profile_summary(profile_dir: Path, warmup: int) -> dict:
    """{rank: {phase: median ms over the steps after ``warmup``}} of a ``--profile`` run."""
    out = {}
    for path in sorted(profile_dir.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()][warmup:]
        keys = [k for k in rows[0] if k.endswith("_ms")]
        out[path.stem] = {k[:-3]: round(float(np.median([r[k] for r in rows])), 1) for k in keys}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if PROFILE_FLAG in argv:   # a rank started by train(..., profile): the deepspeed launcher adds --local_rank
        i = argv.index(PROFILE_FLAG)
        return profiled_rank(Path(argv[i + 1]), argv[:i] + argv[i + 2:])
    args = parse_args(argv)
    out = Path(args.out)
    before = os.getloadavg()[0]
    if not args.only_analyse:
        for policy in args.policies.split(","):
            train(args, policy)
        if args.policies != "static,greedy":
            return 0
    static, dynamic = analyse(out / "static"), analyse(out / "greedy")
    loadavg = [before, os.getloadavg()[0]]
    if args.only_analyse and (out / "result.json").exists():   # keep the load of the runs, not of this re-print
        loadavg = json.loads((out / "result.json").read_text()).get("loadavg", loadavg)
    result = figures(args, static, dynamic, loadavg)
    if args.profile or (out / "profile_static").is_dir():
        result["profile"] = {policy: profile_summary(out / f"profile_{policy}", args.warmup)
                             for policy in ("static", "greedy") if (out / f"profile_{policy}").is_dir()}
    result["plot"] = str(plot(out / "placement_experiment.png", static, dynamic, result))
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
