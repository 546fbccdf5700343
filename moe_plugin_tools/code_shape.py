"""How the package's code is shaped: its docstrings' share of the lines, and where a model family is named.

    python -m moe_plugin_tools.code_shape [--top N]

A docstring line is one inside the docstring of a module, class or function (``ast``); the share is
those lines over all lines of ``moe_plugin/``. The family count lists the lines outside
``moe_plugin/interop/families/`` that spell a model type of the registry as a string.
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moe_plugin"


def docstring_lines(path: Path) -> tuple[int, int]:
    """(docstring lines, all lines) of one file."""
    source = path.read_text()
    inside = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            inside += first.end_lineno - first.lineno + 1
    return inside, source.count("\n")


def docstring_share(root: Path = PACKAGE) -> tuple[int, int, list[tuple[int, int, str]]]:
    rows = [(*docstring_lines(p), str(p.relative_to(root.parent))) for p in sorted(root.rglob("*.py"))]
    return sum(r[0] for r in rows), sum(r[1] for r in rows), rows


def family_lines(model_types: list[str], root: Path = PACKAGE) -> list[str]:
    """``path:line`` of each line outside ``interop/families/`` that spells one of ``model_types``."""
    spelled = re.compile("[\"'](" + "|".join(map(re.escape, model_types)) + ")[\"']")
    out = []
    for path in sorted(root.rglob("*.py")):
        if "families" in path.relative_to(root).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if spelled.search(line):
                out.append(f"{path.relative_to(root.parent)}:{number}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="the files with the most docstring lines")
    args = parser.parse_args(argv)
    inside, total, rows = docstring_share()
    print(f"docstrings: {inside} of {total} lines ({inside / total:.1%})")
    for d, n, p in sorted(rows, reverse=True)[:args.top]:
        print(f"  {d:4d} of {n:4d}  {p}")
    try:
        from moe_plugin.interop.families import REGISTRY
        types = sorted(family.model_type for family in REGISTRY)
    except ImportError:
        types = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3", "deepseek_v2",
                 "gpt_oss", "llama", "mistral", "qwen3"]
    lines = family_lines(types)
    print(f"lines naming a family outside interop/families/: {len(lines)}")
    for line in lines[:args.top]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
