"""Which private names of torch, Lightning, jsonargparse (and argparse) the template's code uses, read from the
syntax tree (tests/test_lightning_internals.py holds every use to the list in app/lightning_internals.py).

A private name is one that starts with ``_`` and is not a dunder. The template's own private names are fine; a
library's are what an upgrade can take away without notice. A use is one of:

- an import of a private name, or from a private module (``from torch.nn.modules.batchnorm import _BatchNorm``);
- in a class with a library class among its bases: ``self._x``, ``def _x``, ``super()._x`` or
  ``getattr(self, "_x")`` where a library class in its MRO has ``_x`` (an attribute, or ``self._x`` in its source);
- anywhere: ``obj._x`` or ``getattr(obj, "_x")`` on anything but ``self``/``cls`` where the template itself defines
  no ``_x`` outside such inherited names (``parser._actions``, ``strategy._start_method``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

LIBRARIES = ("torch", "lightning", "jsonargparse", "argparse", "torchvision", "torchmetrics")


@dataclass(frozen=True, order=True)
class Use:
    path: str  # relative to the scanned root, e.g. app/strategies/dp.py
    line: int
    name: str  # the private name, e.g. _configure_launcher
    how: str  # the source of the use, e.g. "def _configure_launcher"


DOCUMENTED = {"os._exit"}  # private by its name only: documented public API


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _library(obj) -> bool:
    return getattr(obj, "__module__", "").partition(".")[0] in LIBRARIES


_inherited_cache: dict[type, frozenset[str]] = {}


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


def inherited_privates(cls: type) -> frozenset[str]:
    """The private names that the library classes in ``cls``'s MRO define or set on ``self``, or in the MRO of a
    class that mixes ``cls`` in (``class CLI(CkptPathRule, LightningCLI)``: the rule overrides LightningCLI's)."""
    if cls not in _inherited_cache:
        names: set[str] = set()
        for base in {base for sub in _subclasses(cls) for base in sub.__mro__}:
            if not _library(base):
                continue
            names.update(name for name in vars(base) if private(name))
            try:
                source = inspect.getsource(base)
            except (OSError, TypeError):
                continue
            names.update(re.findall(r"\bself\.(_\w+)", source))
        _inherited_cache[cls] = frozenset(n for n in names if private(n))
    return _inherited_cache[cls]


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


class _Scan(ast.NodeVisitor):
    def __init__(self, rel: str, module, own: set[str]) -> None:
        self.rel, self.module, self.own = rel, module, own
        self.uses: list[Use] = []
        self.classes: list[frozenset[str]] = []  # the inherited private names of the enclosing classes

    def add(self, node: ast.AST, name: str) -> None:
        self.uses.append(Use(self.rel, node.lineno, name, ast.unparse(node).split("\n")[0][:100]))

    def inherited(self) -> frozenset[str]:
        return self.classes[-1] if self.classes else frozenset()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.partition(".")[0] in LIBRARIES:
            private_module = any(private(part) for part in node.module.split("."))
            for alias in node.names:
                if private_module or private(alias.name):
                    self.add(node, alias.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        cls = getattr(self.module, node.name, None) if not self.classes else None
        self.classes.append(inherited_privates(cls) if isinstance(cls, type) else self.inherited())
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if private(node.name) and node.name in self.inherited():
            self.add(node, node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _receiver_is_self(self, value: ast.AST) -> bool:
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            return True
        return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"

    def _check(self, node: ast.AST, receiver: ast.AST, name: str) -> None:
        if not private(name):
            return
        if isinstance(node, ast.Attribute) and ast.unparse(node) in DOCUMENTED:
            return
        if self._receiver_is_self(receiver):
            if name in self.inherited():
                self.add(node, name)
        elif name not in self.own:
            self.add(node, name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._check(node, node.args[0], name.value)
        self.generic_visit(node)


def own_private_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Private names the scanned code defines itself: functions, classes, variables, arguments, attributes set."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and not isinstance(getattr(node, "parent", None), ast.ImportFrom):
                own.add(node.asname or node.name)
    return {name for name in own if private(name)}


def scan(root: Path, package: str = "app", skip: tuple[str, ...] = ("lightning_internals.py",)) -> list[Use]:
    """Every use of a library's private name in ``root/package`` (its modules are imported to read their MROs)."""
    paths = sorted(p for p in (root / package).rglob("*.py") if p.name not in skip)
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    scans = []
    for path, tree in trees.items():
        module = importlib.import_module(_module_name(path, root))
        scans.append((path, tree, module))
    inherited = set()
    for _, tree, module in scans:
        for node in tree.body:
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if isinstance(cls, type):
                inherited |= inherited_privates(cls)
    own = own_private_names(trees) - inherited
    uses: list[Use] = []
    for path, tree, module in scans:
        visitor = _Scan(str(path.relative_to(root)), module, own)
        visitor.visit(tree)
        uses += visitor.uses
    return sorted(set(uses))
