"""The generated parts of ``docs/config.md``: each block's table of fields, rendered from the field
descriptions of the config models, and the full example (a tool: the runtime never imports it).

The rest of the page (what is checked, the formulas, the longer notes on a field) is written by
hand. A generated part sits between ``<!-- begin generated: NAME -->`` and ``<!-- end generated:
NAME -->``; after changing a field, rewrite them in place:

    python -m moe_plugin_tools.config_docs            # rewrites docs/config.md's generated parts

(a test fails while the page and this renderer disagree).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

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

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"


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


def generated_parts() -> dict[str, str]:
    """Name -> text of every generated part of the page, in page order."""
    parts = {path: block_table(path, model) for path, model in BLOCKS}
    parts["full example"] = ("## Full example\n\nEvery field spelt out (8 ranks: tensor 2 x pipeline 2, experts "
                             "folded as expert 2 x expert_tensor 1, so dp 2 and edp 2):\n\n```json\n"
                             + json.dumps(full_example(), indent=2) + "\n```")
    return parts


def render_markdown(page: Optional[str] = None) -> str:
    """``page`` (default: ``docs/config.md`` as it is) with every generated part rendered anew; a
    ``ValueError`` names a part whose markers are missing or out of order."""
    if page is None:
        page = PAGE.read_text()
    return fill_generated(page, generated_parts())


def fill_generated(page: str, parts: dict[str, str]) -> str:
    """``page`` with each part of ``parts`` (name -> text) written between its markers."""
    for name, text in parts.items():
        begin, end = f"<!-- begin generated: {name} -->", f"<!-- end generated: {name} -->"
        head, found, rest = page.partition(begin)
        _, found_end, tail = rest.partition(end)
        if not (found and found_end):
            raise ValueError(f"the generated part {name!r} of the page needs the line {begin!r} and, "
                             f"after it, {end!r}")
        page = f"{head}{begin}\n\n{text}\n\n{end}{tail}"
    return page


if __name__ == "__main__":
    page = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
    page.write_text(render_markdown(page.read_text()))
