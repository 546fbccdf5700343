"""Outside ``moe_plugin/compat/`` no code touches DeepSpeed's or Megatron-Core's private state.

The package's AST (and ``moe_plugin_tools``' where it exists) is walked; flagged, with file:line:

(a) ``X._name`` (not a dunder) where the attribute chain starts at a name bound to DeepSpeed or
    Megatron (``import deepspeed``, ``from megatron.core import parallel_state as ps``, or an
    assignment whose value names such a module: ``sys.modules.get("megatron...")``);
(b) ``obj._name`` on any other base except ``self`` / ``cls`` and names bound to other imports
    (``torch._C``), unless the package itself defines ``_name`` (an attribute it assigns, a class
    attribute, a module global, a function) or it is in ``NOT_UPSTREAM``;
(c) ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a constant ``'_name'``: as (a) and
    (b); ``setattr`` / ``delattr`` with a computed name on a DeepSpeed or Megatron object;
(d) ``from deepspeed... import _x`` / ``from megatron... import _x``;
(e) in a class derived from a DeepSpeed or Megatron class: ``Base.__init__(self, ...)`` (a
    subclass that skips its upstream constructor), ``self._name`` as in (b), and a method that
    overrides a private one of the upstream base (the base is imported to tell).
"""
from __future__ import annotations

import ast
import importlib
import re
import textwrap
from pathlib import Path

from launcher import REPO

ROOT = REPO
PACKAGES = ("moe_plugin", "moe_plugin_tools")
COMPAT = ROOT / "moe_plugin" / "compat"
UPSTREAM = re.compile(r"^(deepspeed|megatron)(\.|$)")
# private names on objects of other libraries, reached through a local variable (no import to tell)
NOT_UPSTREAM = {"_cdata": "torch's storage handle (layers/ffn_autograd.py, checkpoint/background.py)",
                "_post_accumulate_grad_hooks": "torch's hooks of a parameter (bench/guard_cost.py puts the guard's "
                                                "back in front of DeepSpeed's)"}
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


class _Bindings(ast.NodeVisitor):
    """Names bound (anywhere in a module) to DeepSpeed / Megatron, and to other imports."""

    def __init__(self) -> None:
        self.upstream: set[str] = set()
        self.other: set[str] = set()
        self.origin: dict[str, tuple[str, str]] = {}   # upstream name -> (module, attribute or "")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            (self.upstream if UPSTREAM.match(alias.name) else self.other).add(bound)
            self.origin[bound] = (alias.name if alias.asname else bound, "")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        upstream = node.level == 0 and UPSTREAM.match(node.module or "")
        for alias in node.names:
            (self.upstream if upstream else self.other).add(alias.asname or alias.name)
            if upstream:
                self.origin[alias.asname or alias.name] = (node.module, alias.name)

    def resolve(self, expr: ast.AST) -> object:
        """The upstream object ``expr`` (a name or attribute chain) names, or None."""
        root, chain = _root(expr), []
        while isinstance(expr, ast.Attribute):
            chain.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(root, ast.Name) or root.id not in self.origin:
            return None
        module, attr = self.origin[root.id]
        try:
            obj = importlib.import_module(module)
            for name in ([attr] if attr else []) + chain:
                obj = getattr(obj, name)
        except (ImportError, AttributeError):
            return None
        return obj

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(c, ast.Constant) and isinstance(c.value, str) and UPSTREAM.match(c.value)
               for c in ast.walk(node.value)):
            self.upstream.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, globals, class and instance attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                        names.add(t.attr)
    return {n for n in names if _private(n)}


def _offences(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    bind = _Bindings()
    bind.visit(tree)
    found: list[tuple[int, str]] = []

    def check(base: ast.AST, name: str, line: int, how: str) -> None:
        root = _root(base)
        rooted = root.id if isinstance(root, ast.Name) else None
        if rooted in bind.upstream:
            found.append((line, f"{how} {name} of {ast.unparse(base)} (bound to deepspeed/megatron)"))
        elif rooted not in ("self", "cls") and rooted not in bind.other and name not in own \
                and name not in NOT_UPSTREAM:
            found.append((line, f"{how} {name} of {ast.unparse(base)} (not a name moe_plugin defines)"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            check(node.value, node.attr, node.lineno, "attribute")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS \
                and len(node.args) >= 2:
            obj, key = node.args[0], node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if _private(key.value):
                    check(obj, key.value, node.lineno, node.func.id)
            elif node.func.id in ("setattr", "delattr") and isinstance(_root(obj), ast.Name) \
                    and _root(obj).id in bind.upstream:
                found.append((node.lineno, f"{node.func.id} of a computed name on {ast.unparse(obj)}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and UPSTREAM.match(node.module or ""):
            found += [(node.lineno, f"import of {a.name} from {node.module}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ClassDef) and any(isinstance(_root(b), ast.Name) and _root(b).id in bind.upstream
                                                    for b in node.bases):
            bases = [bind.resolve(b) for b in node.bases]
            found += [(item.lineno, f"{item.name} of {node.name} overrides a private method of {type_.__name__}")
                      for item in node.body if isinstance(item, ast.FunctionDef) and _private(item.name)
                      for type_ in bases if isinstance(type_, type) and hasattr(type_, item.name)][:1]
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                        and inner.func.attr == "__init__" and not isinstance(inner.func.value, ast.Call):
                    found.append((inner.lineno, f"{ast.unparse(inner.func)} in {node.name}, a subclass of an "
                                                "upstream class: its own constructor skipped"))
                elif isinstance(inner, ast.Attribute) and _private(inner.attr) and isinstance(inner.value, ast.Name) \
                        and inner.value.id == "self" and inner.attr not in own:
                    found.append((inner.lineno, f"attribute {inner.attr} of self in {node.name}, a subclass of an "
                                                "upstream class (not a name moe_plugin defines)"))
    return found


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def find_private_access() -> list[str]:
    """``file:line: what`` for every private DeepSpeed / Megatron access outside ``compat/``."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _modules()}
    own = set().union(*(_defined_privates(t) for p, t in trees.items() if COMPAT not in p.parents))
    return [f"{path.relative_to(ROOT)}:{line}: {what}" for path, tree in trees.items() if COMPAT not in path.parents
            for line, what in sorted(_offences(tree, own))]


def test_no_private_upstream_access_outside_compat():
    found = find_private_access()
    assert not found, ("private DeepSpeed / Megatron-Core state touched outside moe_plugin/compat/ (move it "
                       "behind a function there, with a version guard):\n" + "\n".join(found))


SNIPPET = textwrap.dedent("""
    import sys
    from deepspeed.utils import groups as ds_groups
    from megatron.core.parallel_state import _TENSOR_MODEL_PARALLEL_GROUP
    from deepspeed.moe.layer import MoE
    import torch

    class Marker(MoE):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self._mine = self._gate

        def _apply(self, fn):
            return self

    def f(optimizer, model):
        ds_groups._EXPERT_PARALLEL_GROUP["x"] = 1
        optimizer._global_grad_norm = 0.0
        ps = sys.modules.get("megatron.core.parallel_state")
        setattr(ps, "_MPU_DATA_PARALLEL_RANK", None)
        for name in ("_A", "_B"):
            setattr(ds_groups, name, None)
        getattr(model, "_secret", None)
        return torch._C, model._mine
""")


def test_checker_flags_a_synthetic_offender():
    found = _offences(ast.parse(SNIPPET), own={"_mine"})
    text = "\n".join(what for _, what in found)
    lines = sorted(line for line, _ in found)
    assert lines == [4, 10, 11, 13, 17, 18, 20, 22, 23], text
    for expected in ("import of _TENSOR_MODEL_PARALLEL_GROUP", "Module.__init__ in Marker", "_EXPERT_PARALLEL_GROUP of ds_groups",
                     "_global_grad_norm of optimizer", "setattr _MPU_DATA_PARALLEL_RANK of ps",
                     "setattr of a computed name on ds_groups", "getattr _secret of model",
                     "attribute _gate of self in Marker", "_apply of Marker overrides a private method of MoE"):
        assert expected in text, text
