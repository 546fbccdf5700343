"""Upcycling study: the scaling study's dense model trained half-way, then continued dense, upcycled, or not at all.

    python examples/gpt_moe/scaling/upcycling.py            # four runs, ~10 minutes on 4 CPU ranks (make upcycling)
    python examples/gpt_moe/scaling/upcycling.py --quick    # the same four, tiny, ~1-2 minutes (CI)

On the study's sizes (``family.py``; every linear without bias, ``--disable-bias-linear``, since the
plugin's experts have none and the upcycled model must compute the dense one's function):

1. ``dense-first-half``: the dense model, ``N`` = half the steps, saved;
2. ``dense-continued`` (a): loads it and trains on to the study's step count;
3. ``upcycled-e8-top2`` (b): ``upcycle_checkpoint`` makes 8 experts of FFN f/2 out of it (4 copies of each
   MoE layer's dense MLP, cut in 2, ``gate_scale`` 2: the family's e8-top2 shapes, router and compute
   per token) and the run trains it on, fresh optimizer, same lr schedule and batches;
4. ``e8-top2-scratch`` (c): the e8-top2 model from scratch for all the steps (same tokens as (a), (b)).

Each run is ``pretrain_gpt_moe.py`` through the ``deepspeed`` launcher (``study.py``'s runner: logs,
progress, resume of finished runs, ``--fresh``). At the end: ``OUT/upcycling.png`` (validation loss of
the three, and the training loss after step N), ``OUT/upcycling.md`` and ``OUT/upcycling.json``
(best and final validation loss, tokens, step time), and the table on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from family import SIZES, Sizes  # noqa: E402
from study import ROOT, Study, clock, train  # noqa: E402

GRANULARITY, EXPERTS, TOP_K = 2, 8, 2


@dataclasses.dataclass(frozen=True)
class Phase:
    """One run of the study: a family member (``experts`` 0: dense) trained to ``steps``, from a
    checkpoint (``load``) or not, saving one (``save``); checkpoint names are under OUT/checkpoints."""

    label: str
    experts: int = 0
    top_k: int = 0
    steps: int = 0
    load: str = ""
    save: str = ""
    gate_scale: float = 1.0

    @property
    def name(self) -> str:
        return self.label

    @property
    def dense(self) -> bool:
        return not self.experts


@dataclasses.dataclass
class UpcyclingStudy(Study):
    """``Study`` with the phases' steps, checkpoints, gate scale and bias-free linears."""

    def checkpoint(self, name: str) -> Path:
        return self.out / "checkpoints" / name

    def config(self, phase: Phase) -> dict:
        config = super().config(phase)
        if phase.gate_scale != 1.0:
            config["moe"]["gate_scale"] = phase.gate_scale
        return config

    def command(self, phase: Phase) -> list[str]:
        command = super().command(phase)
        command[command.index("--train-iters") + 1] = str(phase.steps)
        command.append("--disable-bias-linear")
        if phase.load:
            command += ["--load", str(self.checkpoint(phase.load))]
        if phase.save:
            command += ["--save", str(self.checkpoint(phase.save))]
        return command


def phases(sizes: Sizes, half: int) -> list[Phase]:
    total = sizes.train_iters
    return [Phase("dense-first-half", steps=half, save="dense"),
            Phase("dense-continued", steps=total, load="dense"),
            Phase(f"upcycled-e{EXPERTS}-top{TOP_K}", EXPERTS, TOP_K, steps=total, load="upcycled",
                  gate_scale=float(GRANULARITY)),
            Phase(f"e{EXPERTS}-top{TOP_K}-scratch", EXPERTS, TOP_K, steps=total)]


def upcycle(study: UpcyclingStudy, phase: Phase) -> None:
    """The dense half-way checkpoint as ``phase``'s MoE model (its checkpoint directory made anew)."""
    from moe_plugin.checkpoint import upcycle_checkpoint

    target = study.checkpoint(phase.load)
    shutil.rmtree(target, ignore_errors=True)
    done = upcycle_checkpoint(study.checkpoint("dense"), study.config(phase), target, granularity=GRANULARITY,
                              seed=study.sizes.seed, progress=lambda line: None)
    print(f"upcycled {done.source} -> {done.path}: {done.num_experts} experts (granularity {done.granularity}) on "
          f"layers {list(done.moe_layers)}, resuming at step {done.global_steps}", flush=True)


# -- the comparison ------------------------------------------------------------------------------
def rows(study: UpcyclingStudy, runs: list[Phase], half: int) -> list[dict]:
    """One row per compared run: (a) and (b) joined to the first half they continue."""
    from moe_plugin_tools.report.rundir import read_run
    from moe_plugin_tools.report.summary import summarize

    read = {p.name: read_run(study.run_dir(p)) for p in runs}
    first, continued, upcycled, scratch = runs
    out = []
    for label, parts in (("(a) dense, continued dense", [first, continued]),
                         (f"(b) dense, upcycled to e{EXPERTS}-top{TOP_K}", [first, upcycled]),
                         (f"(c) e{EXPERTS}-top{TOP_K} from scratch", [scratch])):
        last = read[parts[-1].name]
        summary = summarize(last)
        valid = sorted((r["step"], r["loss"]) for p in parts for r in read[p.name].valid)
        train = sorted((r["step"], r["loss"]) for p in parts for r in read[p.name].train)
        after = next((loss for step, loss in train if step == half + 1), None)
        out.append({"run": label, "runs": [p.name for p in parts], "steps": train[-1][0],
                    "tokens": train[-1][0] * summary.tokens_per_step, "params": summary.params and summary.params.total,
                    "params_active": summary.params and summary.params.active,
                    "train_loss_after_half": after, "median_step_ms_after_half": 1e3 * summary.median_step_s,
                    "best_valid_loss": min(loss for _, loss in valid), "final_valid_loss": valid[-1][1],
                    "valid": valid, "train": train})
    return out


def table(records: list[dict], half: int) -> str:
    lines = [f"| run | steps | tokens | parameters (active) | train loss, step {half + 1} | step (ms), steps > {half} "
             "| best valid loss | final valid loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['run']} | {r['steps']:,} | {r['tokens']:,} | {r['params'] / 1e6:.2f} M "
                     f"({r['params_active'] / 1e6:.2f} M) | {r['train_loss_after_half']:.3f} | "
                     f"{r['median_step_ms_after_half']:.0f} | {r['best_valid_loss']:.4f} | {r['final_valid_loss']:.4f} |")
    return "\n".join(lines)


def plot(records: list[dict], half: int, path: Path) -> Path:
    from moe_plugin_tools.report.plots import _pyplot, _save, smoothed

    plt = _pyplot()
    fig, (ax_valid, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, style in zip(records, ("o-", "s-", "^-")):
        ax_valid.plot([s for s, _ in r["valid"]], [v for _, v in r["valid"]], style, ms=3, label=r["run"])
        tail = [(s, v) for s, v in r["train"] if s > half]
        window = max(1, len(tail) // 25)
        ax_train.plot([s for s, _ in tail], smoothed([v for _, v in tail], window), lw=1, label=r["run"])
    tails = [v for r in records for s, v in r["valid"] if s >= half // 2]
    if tails:
        ax_valid.set_ylim(min(tails) - 0.05, max(tails) + 0.1)
    for ax, title in ((ax_valid, "validation loss"), (ax_train, f"training loss after step {half} (trailing mean)")):
        ax.axvline(half, color="grey", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("cross entropy (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


# -- the run -------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps: checks the machinery (CI)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per run (deepspeed --num_gpus)")
    parser.add_argument("--half", type=int, default=None, help="steps of the first dense run (default: half)")
    parser.add_argument("--out", default=None, help="study directory (default: runs/upcycling or runs/upcycling_quick)")
    parser.add_argument("--data-cache", default=str(ROOT / "data"), help="where the stdlib corpus is written once")
    parser.add_argument("--fresh", action="store_true", help="train every run again, even if already trained")
    parser.add_argument("--master-port", type=int, default=29631, help="the launcher's rendezvous port")
    args = parser.parse_args(argv)
    if args.ranks < 1 or (args.ranks < EXPERTS and EXPERTS % args.ranks):
        parser.error(f"--ranks: got {args.ranks}; must divide {EXPERTS} (the experts) or be larger")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    half = args.half or sizes.train_iters // 2
    if not 0 < half < sizes.train_iters:
        print(f"error: --half: got {half}; expected 1 to {sizes.train_iters - 1}", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "runs" / ("upcycling_quick" if args.quick else "upcycling")).resolve()
    runs = phases(sizes, half)
    study = UpcyclingStudy(sizes, runs, args.ranks, out, args.data_cache, args.master_port)
    out.mkdir(parents=True, exist_ok=True)
    print(f"upcycling study: dense {half} steps, then dense / upcycled e{EXPERTS}-top{TOP_K} to {sizes.train_iters}, "
          f"and e{EXPERTS}-top{TOP_K} from scratch; {args.ranks} ranks -> {out}", flush=True)
    started, durations, wall, retrain = time.monotonic(), [], {}, args.fresh
    for index, phase in enumerate(runs, start=1):
        again = args.fresh or (retrain and bool(phase.load))   # runs from a checkpoint trained anew follow it
        if study.trained(phase) and not again:
            print(f"[{index}/{len(runs)}] {phase.name} | already trained ({study.run_dir(phase)})", flush=True)
            continue
        if phase.load == "upcycled":
            upcycle(study, phase)
        wall[phase.name] = train(study, index, phase, started, durations)
        durations.append(wall[phase.name])
        retrain = retrain or bool(phase.save)
    records = rows(study, runs, half)
    text = table(records, half)
    (out / "upcycling.md").write_text(text + "\n")
    (out / "upcycling.json").write_text(json.dumps({
        "sizes": dataclasses.asdict(sizes), "half": half, "ranks": args.ranks, "granularity": GRANULARITY,
        "wall_s_this_invocation": {k: round(v, 1) for k, v in wall.items()}, "rows": records}, indent=1) + "\n")
    png = plot(records, half, out / "upcycling.png")
    print(text)
    print(f"plot: {png}  table: {out / 'upcycling.md'}  ({clock(time.monotonic() - started)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
