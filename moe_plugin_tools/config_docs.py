"""``docs/config.md``, rendered from the field descriptions of the config models (a tool: the runtime
never imports it).

Regenerate after changing a field:  python -m moe_plugin_tools.config_docs > docs/config.md
(a test fails while the file and this renderer disagree).
"""
from __future__ import annotations

import json

from pydantic import BaseModel

from moe_plugin.configs.fields import bounds, default_text, type_name
from moe_plugin.configs.schema import ROOT_KEY, MoEConfig, ParallelConfig, PlacementConfig

BLOCKS: tuple[tuple[str, type[BaseModel]], ...] = (
    (ROOT_KEY, MoEConfig),
    (f"{ROOT_KEY}.parallel", ParallelConfig),
    (f"{ROOT_KEY}.placement", PlacementConfig),
)

# The "moe" block of the full example; every other field is shown at its default.
EXAMPLE_BLOCK = {
    "num_experts": 8,
    "router": "gshard",
    "layer_interval": 2,
    "parallel": {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1},
    "placement": {"policy": "greedy", "check_interval": 200},
}

INTRO = """\
# The `"moe"` block of the DeepSpeed config

The plugin reads one block, `"moe"`, from the DeepSpeed JSON you already pass to
`deepspeed.initialize` (DeepSpeed ignores top-level keys it does not know). Only
`num_experts` is required. Unknown keys, wrong types (`"8"` for `8`, `true` for a number) and
inconsistent sizes are errors that name the key path, the bad value and what is valid, and
they are raised before any process group exists (see *What is checked, and when* below). Check
a file with

    moe-plugin check-config ds_config.json --world-size 8

which prints the resolved block (every field, defaults included) and the rank layout.

*This page is generated from the field descriptions in `moe_plugin/configs/schema.py` by
`python -m moe_plugin_tools.config_docs > docs/config.md`; edit the descriptions, not this page.*

## What is checked, and when

Every check below runs on the config and the flags alone, on every rank, before any process
group, model or file exists; a mistake is a `ConfigError` whose one-line message names the key
path (or flag, or file), the value found and what is valid.

- **The file** is read as `deepspeed.initialize` reads it (DeepSpeed 0.19.8 uses hjson):
  comments (`//`, `#`, `/* */`) and trailing commas are accepted; a key written twice, at any
  depth, is an error naming its path and both values (DeepSpeed refuses it too; plain `json`
  would keep the last one silently).
- **The `"moe"` block**: types, bounds and unknown keys at any depth, each with the near miss it
  resembles (`moe.num_experts: missing; ...; the block has 'num_expert' (did you mean
  'num_experts'?)`); `num_experts` and the world size are at most 2^20, larger values are refused
  at once (divisor lists are computed by trial division up to the square root and cut when long).
- **Values nothing would read**: a field set to another value than its default that the other
  settings ignore is an error naming why (`normalize_gates` false with gshard or switch,
  `second_expert_policy` without gshard, the capacity fields and `drop_policy` when dropless,
  `overlap_chunks` or a placement policy without expert parallelism, the placement's tuning
  fields under static placement, `slack` without network-aware placement, `sequence_parallel`
  without tensor parallelism); writing a default out is never an error. No default depends on
  the layout: `router_groups` is written whenever `group_topk` is.
- **The layout** against the world size (`Sizes` below).
- **DeepSpeed's batch arithmetic** against the layout's data-parallel size `dp`:
  `train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp`, each an
  integer >= 1. A number the JSON leaves out is derived as DeepSpeed derives it and must come out
  even; a top-level key that is a near miss of one of the three names (DeepSpeed would ignore it)
  is an error. Where `gradient_accumulation_steps` is left out it follows from the world size
  (16 = micro 4 x 1 x dp 4, but x 2 x dp 2; `moe_plugin.initialize` then logs a warning on rank
  0): write all three numbers so that a JSON launched on another world size is refused instead
  of followed.
- `moe_plugin.initialize` runs all of these, then the ZeRO and pipeline settings it supports;
  `moe-plugin check-config` runs them (the batch arithmetic when it knows the world size). The
  example (`examples/gpt_moe/pretrain_gpt_moe.py`) adds its flags, `moe.layers` within
  `--num-layers`, its data (the `.idx`/`.bin` pair against the sizes and offsets its index
  promises: an empty, truncated or garbage file names the file, expected vs found) and the data's
  largest token id against `--vocab-size`.

Under the `deepspeed` launcher every rank raises the same `ConfigError`; it is reported once:
`with moe_plugin.exit_on_config_error(): ...` (or `return moe_plugin.report_config_error(err)`)
prints `error: <message>` on rank 0 only and exits with status 2 on every rank, as the example
and the `moe-plugin` command do.

## Formulas

- **Capacity** (tokens one expert takes per step, when `drop_tokens` is true):
  `capacity = max(min_capacity, ceil(capacity_factor * k * T / E))`, with `k` the experts per
  token (`top_k`), `T` the tokens of one forward pass's micro-batch (of one data-parallel replica: its
  tensor/sequence-parallel ranks route their shares together, as one rank would) and `E` =
  `num_experts`; `eval_capacity_factor` replaces `capacity_factor` in evaluation. It is
  computed exactly: the factor is the decimal number written (1.1 is 11/10) and the rest is
  integer arithmetic, so 1.1 x 2 x 200 / 8 gives 55 on every rank (floating point would give
  56); the layer, the reference MoE and the planner share `moe_plugin.configs.expert_capacity`.
  Routes over capacity are dropped (first choices take slots before second choices, earlier
  tokens before later ones) and their tokens pass through the residual connection.
- **Balance loss** (GShard): `balance = E * sum_e f_e * p_e`, with `f_e` the fraction of tokens
  whose first choice is expert `e` and `p_e` the mean gate probability of expert `e`. It is
  exactly 1 for uniform routing; `aux_loss_coeff * balance` is added to the loss.
- **Router z-loss** (ST-MoE): `z = mean_t (logsumexp_e logits_te)^2`; `z_loss_coeff * z` is added.
- **Aux-loss-free balancing** (DeepSeek-V3; `bias_update_rate` = `u` > 0): each router holds a
  buffer `expert_bias` [E] added to the logits (sigmoid: the scores) for choosing experts only;
  the gates stay unbiased. Once per optimizer step `b_e += u * sign(mean(load) - load_e)`, with
  `load_e` the routes expert `e` was chosen for (before capacity) in every training forward of
  the step (all micro-batches; evaluation forwards do not count), summed over the ranks that
  route distinct tokens (one all-reduce of [E] per layer and step): the bias is the same on
  every rank and for every layout.
  `moe_plugin.initialize` applies it by itself after `engine.step()` / `train_batch` (at the
  next forward; fp16 steps skipped for overflow included), `save_checkpoint` saves it with the
  last step's update (`docs/long_runs.md`, *Once per optimizer step*). A loop whose optimizer
  steps outside `engine.step()` calls `result.end_step()` after each step; a model built
  without `initialize` calls `MoELayer.update_expert_bias()` of every MoE layer, on every rank.
- **Sizes** for a world of `W` ranks: data-parallel `dp = W / (tensor * pipeline)`,
  expert-data-parallel `edp = W / (pipeline * expert * expert_tensor)`. `expert` must divide
  `num_experts`; `tensor * pipeline` and `expert * expert_tensor * pipeline` must divide `W`.
  Each expert-parallel rank hosts `num_experts / expert` experts. With `pipeline` > 1 keep `pp`
  last in `order`; any other order needs `edp == dp` and both grids placing pipeline stages
  equally many ranks apart.
- **MoE layers**: layer `i` (0-based) has an MoE MLP when `i % layer_interval == 0`, or, when
  `layers` is set, when `i` is listed there.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def block_table(path: str, model: type[BaseModel]) -> str:
    """A markdown table of one block's fields: key, type, default, meaning."""
    summary = (model.__doc__ or "").strip().splitlines()[0].replace("``", "`")
    lines = [f"## `{path}`", "", summary, "",
             "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        kind = type_name(field.annotation) + (f", {bounds(field)}" if bounds(field) else "")
        default = default_text(field)
        default = default if default in ("required", "see below") else f"`{_cell(default)}`"
        lines.append(f"| `{name}` | {_cell(kind)} | {default} | {_cell(field.description or '')} |")
    return "\n".join(lines)


def full_example() -> dict:
    """A DeepSpeed config whose "moe" block spells out every field."""
    block = MoEConfig.from_dict(EXAMPLE_BLOCK).resolved_dict()
    return {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {"stage": 1}, ROOT_KEY: block}


def render_markdown() -> str:
    parts = [INTRO.rstrip()] + [block_table(path, model) for path, model in BLOCKS]
    parts.append("## Full example\n\nEvery field spelt out (8 ranks: tensor 2 x pipeline 2, experts "
                 "folded as expert 2 x expert_tensor 1, so dp 2 and edp 2):\n\n```json\n"
                 + json.dumps(full_example(), indent=2) + "\n```")
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
