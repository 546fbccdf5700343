"""The scaling study for a GPU cluster: its family at 125M and 350M, 8 to 128 experts, planned layouts.

    python examples/gpt_moe/scaling/gpu_recipe.py            # (re)writes gpu/configs/*.json and gpu/plan.md
    examples/gpt_moe/scaling/gpu/run_gpu.sh 125m e64-top2 HOSTFILE [--data-path PREFIX] [flags]

The same construction as the CPU study (``family.py``): a dense GPT and MoE GPTs whose top-k
experts each have FFN size f / k, so every member does the dense model's compute per token; MoE
on every other layer; the same global batch and steps for all. For each member the planner
(``moe_plugin.planner``, the cluster of ``CLUSTER``) searches every layout of the cluster's
GPUs and the fastest one that fits goes into the member's DeepSpeed JSON. The dense model is
planned as a one-expert MoE (same compute, expert parallelism 1) without pipeline parallelism, which the example's
``--dense`` does not take. The JSONs are committed; the
test suite checks that they pass ``moe-plugin check-config`` and that this script reproduces them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OUT = HERE / "gpu"
CLUSTER = ROOT / "examples" / "gpt_moe" / "planner" / "cluster_8x8_a100.json"
EXPERTS = (8, 16, 32, 64, 128)
TOP_K = 2
VOCAB = 50304            # GPT-2 BPE (50257) padded to a multiple of 128
GLOBAL_BATCH = 256       # sequences per step
TRAIN_ITERS = 20000


@dataclass(frozen=True)
class GpuSize:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    lr: float


SIZES = (GpuSize("125m", 12, 768, 12, 3072, 1024, 6e-4), GpuSize("350m", 24, 1024, 16, 4096, 1024, 3e-4))


def member_names() -> list[str]:
    return ["dense"] + [f"e{e}-top{TOP_K}" for e in EXPERTS]


def planner_model(size: GpuSize, experts: int):
    """The planner's model of one member: its run's DeepSpeed JSON and shape (``experts`` 0: the dense one, as a
    one-expert MoE; the planner fills in ``parallel``)."""
    from moe_plugin.planner import PlanModel

    k = TOP_K if experts else 1
    moe = {"num_experts": max(experts, 1), "router": {1: "switch", 2: "gshard"}[k], "top_k": k, "layer_interval": 2,
           "parallel": {}, "capacity_factor": 1.25, "ffn_hidden_size": size.ffn // k}
    if experts:
        moe.update(eval_capacity_factor=2.0, min_capacity=4, aux_loss_coeff=0.01)
    shape = {"num_layers": size.layers, "hidden_size": size.hidden, "ffn_hidden_size": size.ffn,
             "num_attention_heads": size.heads, "vocab_size": VOCAB, "seq_length": size.seq}
    return PlanModel.build({"train_batch_size": GLOBAL_BATCH, "bf16": {"enabled": True}, "moe": moe}, shape)


def member_config(size: GpuSize, experts: int, cluster) -> tuple[dict, dict]:
    """(the DeepSpeed JSON, the planner's row for plan.md) of one member."""
    from moe_plugin.planner import candidate_pool, ds_config, search

    model = planner_model(size, experts)
    candidates = [c for c in search(model, cluster) if experts or c.layout.pp == 1]   # --dense: no pipeline
    best = candidate_pool(candidates, 1)[0]
    config = ds_config(model, best.layout)
    config["steps_per_print"] = 10 ** 9
    config["optimizer"]["params"]["lr"] = size.lr
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": size.lr,
                                                               "warmup_num_steps": 2000,
                                                               "total_num_steps": TRAIN_ITERS}}
    if not experts:   # the dense baseline keeps the planned tp / pp / ZeRO; the example's --dense ignores the experts
        config["moe"] = {"num_experts": 1, "router": "switch",
                         "parallel": {**config["moe"]["parallel"], "expert": 1, "expert_tensor": 1}}
    row = {"layout": best.layout.name(), "step_ms": 1e3 * best.cost.total, "memory_gb": best.cost.memory_total / 1e9,
           "tokens_per_s": GLOBAL_BATCH * size.seq / best.cost.total}
    return config, row


def generate(out: Path = OUT, progress: bool = True) -> list[Path]:
    """Write ``out/configs/<size>_<member>.json`` and ``out/plan.md``; return the files."""
    from moe_plugin.planner import ClusterSpec
    from moe_plugin_tools.report.params import count_params

    cluster = ClusterSpec.load(str(CLUSTER))
    (out / "configs").mkdir(parents=True, exist_ok=True)
    written, rows = [], []
    for size in SIZES:
        for experts, name in zip((0, *EXPERTS), member_names()):
            if progress:
                print(f"planning {size.name} {name} on {cluster.world_size} GPUs", file=sys.stderr, flush=True)
            config, row = member_config(size, experts, cluster)
            path = out / "configs" / f"{size.name}_{name}.json"
            path.write_text(json.dumps(config, indent=2) + "\n")
            written.append(path)
            args = {"num_layers": size.layers, "hidden_size": size.hidden, "ffn_hidden_size": size.ffn,
                    "seq_length": size.seq, "dense": not experts}
            params = count_params(args, config["moe"], VOCAB)
            rows.append((size.name, name, params, row))
    plan = out / "plan.md"
    plan.write_text(render_plan(cluster, rows))
    return written + [plan]


def render_plan(cluster, rows: list) -> str:
    lines = [f"# GPU recipe: planned layouts on {cluster.name}", "",
             f"Written by `python examples/gpt_moe/scaling/gpu_recipe.py` (the planner's cost model of "
             f"`{CLUSTER.relative_to(ROOT)}`; predictions, not measurements). Every member: global batch "
             f"{GLOBAL_BATCH} x {SIZES[0].seq} tokens, MoE on every other layer, top-{TOP_K} experts of FFN f/{TOP_K}, "
             f"bf16, {TRAIN_ITERS} steps.", "",
             "| size | model | parameters | active / token | layout (tp-ep-dp/ZeRO/micro x gas) | "
             "predicted step (ms) | memory / GPU (GB) | tokens/s |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for size, name, params, row in rows:
        lines.append(f"| {size} | {name} | {params.total / 1e6:,.0f} M | {params.active / 1e6:,.0f} M | "
                     f"{row['layout']} | {row['step_ms']:.0f} | {row['memory_gb']:.1f} | {row['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where configs/ and plan.md go")
    args = parser.parse_args(argv)
    for path in generate(Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
