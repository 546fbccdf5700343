"""docs/huggingface.md's table of families, rendered from the registry (``moe_plugin.interop.families``):
a row per family, its ``model_type``, class, known releases and what the plugin sets (``Family.sets``).

    python -m moe_plugin_tools.family_docs            # rewrites the table in place

(a test fails while the page and the registry disagree).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from moe_plugin.interop.families import REGISTRY
from moe_plugin_tools.config_docs import fill_generated

PAGE = Path(__file__).resolve().parent.parent / "docs" / "huggingface.md"
PART = "families"


def family_table() -> str:
    rows = ["| `model_type` | class | what the plugin sets |", "|---|---|---|"]
    for f in REGISTRY:
        known = f" ({f.checkpoints})" if f.checkpoints else ""
        rows.append(f"| `{f.model_type}` | `{f.architecture}`{known} | {f.sets} |")
    return "\n".join(rows)


def render_markdown(page: Optional[str] = None) -> str:
    return fill_generated(PAGE.read_text() if page is None else page, {PART: family_table()})


if __name__ == "__main__":
    PAGE.write_text(render_markdown())
