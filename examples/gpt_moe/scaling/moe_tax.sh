#!/usr/bin/env bash
# The MoE tax of the scaling study's e8-top2 against its dense model, with the breakdown of a step.
#
#   examples/gpt_moe/scaling/moe_tax.sh [OUT] [STEPS]      (defaults: runs/moe_tax, 300)
#
# Three runs of pretrain_gpt_moe.py on 4 ranks with the study's sizes and JSON (family.py): dense,
# e8-top2 with moe.exchange "counts" (the default) and with "auto" (padded on gloo), STEPS steps each,
# validation every 100; steps 100-119 run under --profile (parts.json) and are left out of the
# median step time. Prints the median step of each, its ratio to the dense one, the validation
# losses, and a table of the parts (ms per step, mean over the ranks). docs/benchmarks_history.md, "The MoE tax".
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/moe_tax}; STEPS=${2:-300}; PY=${PYTHON:-python}; PORT=${MASTER_PORT:-29733}
mkdir -p "$OUT"
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
sys.path.insert(0, "examples/gpt_moe/scaling")
from family import SIZES, by_name, ds_config
out, sizes = pathlib.Path(sys.argv[1]), SIZES["full"]
(out / "dense.json").write_text(json.dumps(ds_config(by_name(sizes, ["dense"])[0], sizes, ranks=4), indent=1))
for mode in ("counts", "auto"):
    config = ds_config(by_name(sizes, ["e8-top2"])[0], sizes, ranks=4)
    config["moe"]["exchange"] = mode
    (out / f"e8-top2-{mode}.json").write_text(json.dumps(config, indent=1))
PY
for run in dense e8-top2-counts e8-top2-auto; do
  extra=(); [ "$run" = dense ] && extra=(--dense)
  echo "$run: $STEPS steps on 4 ranks -> $OUT/$run.log"
  deepspeed --num_gpus 4 --master_port "$PORT" examples/gpt_moe/pretrain_gpt_moe.py --deepspeed_config "$OUT/$run.json" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 --seq-length 128 \
    --max-position-embeddings 128 --micro-batch-size 4 --train-iters "$STEPS" --eval-interval 100 --eval-iters 8 \
    --log-interval 50 --seed 1234 --corpus-bytes 4194304 --valid-fraction 0.05 --untie-embeddings-and-output-weights \
    --run-dir "$OUT/$run" --profile --profile-step-start 100 --profile-step-end 120 "${extra[@]}" > "$OUT/$run.log" 2>&1
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, statistics, sys
from moe_plugin_tools.bench.step_parts import table
out, runs, parts = pathlib.Path(sys.argv[1]), {}, {}
for run in ("dense", "e8-top2-counts", "e8-top2-auto"):
    records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_s"] for r in records if r.get("split") == "train" and not 100 < r["step"] <= 120]
    runs[run] = (1e3 * statistics.median(steps), [(r["step"], round(r["loss"], 4)) for r in records
                                                   if r.get("split") == "valid"])
    parts[run] = json.loads((out / run / "parts.json").read_text())["mean"]
for run, (ms, valid) in runs.items():
    print(f"{run:15s} median step {ms:6.1f} ms, x dense {ms / runs['dense'][0]:.3f}, validation {valid}")
print(table(parts))
PY
