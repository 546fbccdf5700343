"""The packages' shape: no import cycle among the modules of ``moe_plugin`` and ``moe_plugin_tools``
(every import statement counts, those inside functions too); the runtime ``moe_plugin`` never
imports the tools; ``import moe_plugin`` and the ``moe-plugin`` command's start-up stay light (no torch,
DeepSpeed or Megatron-Core) and every name a package's ``__all__`` lists resolves."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from launcher import REPO

PACKAGES = ("moe_plugin", "moe_plugin_tools")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (never run, so no import edge)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _type_checking(child))


def imported_names(module: str, path: Path) -> set[str]:
    """Every name an import statement of the file imports (``from a import b``: ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            names.update(f"{source}.{alias.name}" for alias in node.names)   # a.b, or a where b is no module
    return names


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (the longest known prefix of each name)."""
    files = module_files(root, packages)

    def known(name: str) -> Optional[str]:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {t for t in map(known, imported_names(m, p)) if t and t != m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first, iterative)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, todo = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from .sub import y\n    return y\n")
    (pkg / "sub" / "y.py").write_text("import os\nfrom pkg.x import f\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.x"] == {"pkg.sub.y"} and graph["pkg.sub.y"] == {"pkg.x"}
    assert find_cycle(graph) == ["pkg.sub.y", "pkg.x", "pkg.sub.y"]


def test_no_import_cycle():
    graph = import_graph(REPO)
    assert len(graph) > 80 and "moe_plugin_tools.cli" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_runtime_never_imports_the_tools():
    found = sorted(f"{m} imports {name}" for m, path in module_files(REPO, ("moe_plugin",)).items()
                   for name in imported_names(m, path) if name.split(".")[0] == "moe_plugin_tools")
    assert len(found) == 0, "; ".join(found)


def test_import_moe_plugin_is_light_and_every_public_name_resolves():
    code = ("import json, sys\nimport moe_plugin\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'megatron'))\n"
            "missing = [n for n in moe_plugin.__all__ if getattr(moe_plugin, n, None) is None]\n"
            "print(json.dumps({'heavy': heavy, 'missing': missing, 'all': moe_plugin.__all__, 'dir': dir(moe_plugin)}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == [], "import moe_plugin imported " + ", ".join(seen["heavy"][:10])
    assert seen["missing"] == []
    user_needs = {"initialize", "MoEConfig", "MoELayer", "gpt_moe_spec", "save_checkpoint", "load_checkpoint",
                  "ExpertMetrics", "training_placement", "transformer_config", "gpt_pipeline_module", "ConfigError",
                  "exit_on_error", "report_error"}
    assert user_needs <= set(seen["all"]) and set(seen["all"]) <= set(seen["dir"])


def test_the_command_starts_without_torch():
    # what the lazy tables of moe_plugin, groups, interop, checkpoint, data and bench keep out of the CLI
    config = REPO / "examples" / "gpt_moe" / "configs" / "tiny_cpu_4rank.json"
    code = ("import contextlib, io, json, sys\n"
            "from moe_plugin_tools.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['check-config', {str(config)!r}])\n"
            "from moe_plugin.data import stdlib_jsonl   # the stdlib-jsonl command's import\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'megatron'))\n"
            "print(json.dumps(heavy))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert heavy == [], "moe-plugin check-config imported " + ", ".join(heavy[:10])


def test_every_name_in_a_packages_all_resolves():
    # the top-level package is checked above, in a fresh process
    packages = sorted(m for m, path in module_files(REPO).items() if path.name == "__init__.py" and "." in m)
    listed = {}
    for name in packages:
        exported = getattr(importlib.import_module(name), "__all__", None)
        if exported is not None:
            listed[name] = list(exported)
    assert {"moe_plugin.configs", "moe_plugin.data", "moe_plugin.groups", "moe_plugin.interop"} <= set(listed)
    duplicated = {p: sorted({n for n in names if names.count(n) > 1}) for p, names in listed.items()}
    assert not any(duplicated.values()), duplicated
    missing = [f"{p}.{n}" for p, names in listed.items() for n in names
               if getattr(importlib.import_module(p), n, None) is None]
    assert missing == [], "listed in __all__ but not found: " + ", ".join(missing)


def _lazy_table(path: Path) -> Optional[dict]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_LAZY":
            return ast.literal_eval(node.value)
    return None


def test_a_lazy_table_names_what_its_type_checking_block_imports():
    # editors and type checkers follow the block; the table is what runs: the two agree, name for name,
    # each name from the module that defines it (a subpackage's lazy name: that subpackage's module)
    files = module_files(REPO)
    tables = {m: table for m, path in files.items() if path.name == "__init__.py"
              if (table := _lazy_table(path)) is not None}
    assert {"moe_plugin", "moe_plugin.checkpoint", "moe_plugin.data", "moe_plugin.groups", "moe_plugin.interop",
            "moe_plugin_tools.bench"} <= set(tables)
    for package, table in tables.items():
        def defining(name: str, module: str) -> str:
            return f"{module}.{tables[module][name]}" if module in tables else module

        wanted = {name: defining(name, f"{package}.{module}") for name, module in table.items()}
        [block] = [n for n in ast.parse(files[package].read_text()).body if _type_checking(n)]
        imported = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        assert imported == wanted, (package, sorted(set(imported.items()) ^ set(wanted.items())))
        module = importlib.import_module(package)
        for name, source in wanted.items():
            assert getattr(module, name) is getattr(importlib.import_module(source), name), f"{package}.{name}"
