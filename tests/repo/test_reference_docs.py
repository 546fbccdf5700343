"""The reference docs keep up with the code: ``docs/architecture.md`` names every module of
``moe_plugin`` and ``moe_plugin_tools`` (and none that is gone), and the config schema's field
descriptions stay short, their longer explanation living in ``docs/config.md``."""
from __future__ import annotations

import re

import pytest

from launcher import REPO
from moe_plugin.configs.schema import MoEConfig, ParallelConfig, PlacementConfig

PACKAGES = ("moe_plugin", "moe_plugin_tools")
# A description says what the field is, its default and its constraint; the rest is docs/config.md's.
MAX_DESCRIPTION = 200


def modules_on_disk() -> set[str]:
    """Every module file of the packages, as a path from the repository root; but the family modules,
    which docs/huggingface.md's table lists (test_hf's registry test)."""
    from moe_plugin.interop.families import REGISTRY

    families = {f"moe_plugin/interop/families/{type(f).__module__.rsplit('.', 1)[1]}.py" for f in REGISTRY}
    return {path.relative_to(REPO).as_posix() for package in PACKAGES
            for path in (REPO / package).rglob("*.py") if "__pycache__" not in path.parts} - families


def modules_in_doc(text: str) -> dict[str, str]:
    """Module path -> its line, from the ``## Modules`` section: a ``### `package/` `` heading, then
    one ``- `module.py`: what it is for`` line per module."""
    section = text.partition("\n## Modules\n")[2].partition("\n## ")[0]
    named, package = {}, None
    for line in section.splitlines():
        heading = re.fullmatch(r"### `([\w/]+/)`", line.strip())
        if heading:
            package = heading.group(1)
            continue
        item = re.match(r"- `(\w+\.py)`(.*)", line)
        if item:
            assert package is not None, f"docs/architecture.md: {line!r} comes before any package heading"
            path = package + item.group(1)
            assert path not in named, f"docs/architecture.md names {path} twice"
            named[path] = item.group(2)
    return named


def test_architecture_doc_names_every_module():
    named = modules_in_doc((REPO / "docs" / "architecture.md").read_text())
    on_disk = modules_on_disk()
    missing, gone = sorted(on_disk - set(named)), sorted(set(named) - on_disk)
    assert not missing, f"docs/architecture.md, ## Modules: add a line for each of {missing}"
    assert not gone, f"docs/architecture.md, ## Modules: no such module (renamed or removed?): {gone}"
    unexplained = [path for path, rest in named.items() if not re.match(r":\s*\S", rest)]
    assert not unexplained, f"docs/architecture.md: say what each is for (`name.py`: ...): {unexplained}"


def test_module_list_parser_sees_missing_and_gone_modules():
    doc = ("# x\n\n## Modules\n\n### `moe_plugin/`\n- `__init__.py`: the API\n- `gone.py`: removed\n\n"
           "### `moe_plugin/layers/`\n- `router.py`: routing\n\n## Rules\n- `later.py`: not a module line\n")
    assert modules_in_doc(doc) == {"moe_plugin/__init__.py": ": the API", "moe_plugin/gone.py": ": removed",
                                   "moe_plugin/layers/router.py": ": routing"}


@pytest.mark.parametrize("model", [MoEConfig, ParallelConfig, PlacementConfig], ids=lambda m: m.__name__)
def test_schema_descriptions_are_short(model):
    for name, field in model.model_fields.items():
        text = field.description or ""
        assert text, f"{model.__name__}.{name} has no description"
        assert len(text) <= MAX_DESCRIPTION, (
            f"{model.__name__}.{name}: description of {len(text)} characters (at most {MAX_DESCRIPTION}: what, "
            "default, constraint); move the explanation to docs/config.md, under its block's table")


def test_config_page_generated_parts_are_rewritten_and_the_rest_is_kept():
    from moe_plugin_tools.config_docs import generated_parts, render_markdown

    names = list(generated_parts())
    page = "hand-written intro\n" + "".join(f"<!-- begin generated: {n} -->\nstale\n<!-- end generated: {n} -->\n"
                                            f"notes on {n}\n" for n in names)
    out = render_markdown(page)
    assert "stale" not in out and out.startswith("hand-written intro\n")
    assert all(f"notes on {n}\n" in out for n in names)
    assert "| `exchange` |" in out and render_markdown(out) == out
    with pytest.raises(ValueError, match="'moe.parallel'"):
        render_markdown(page.replace("<!-- end generated: moe.parallel -->", ""))
