"""Which private names of torch, Lightning, jsonargparse (and argparse) the template's code uses, read from the
syntax tree (tests/test_lightning_internals.py holds every use to the list in app/lightning_internals.py).

A private name is one that starts with ``_`` and is not a dunder. The template's own private names are fine; a
library's are what an upgrade can take away without notice. A use is one of:

- an import of a private name, or of or from a private module (``from torch.nn.modules.batchnorm import _BatchNorm``,
  ``import torch._dynamo as dynamo``);
- in a class with a library class among its bases: ``self._x``, ``def _x``, ``super()._x`` or
  ``getattr(self, "_x")`` where a library class in its MRO has ``_x`` (an attribute, or ``self._x`` in its source);
- anywhere: ``obj._x`` or ``getattr(obj, "_x")`` on anything but ``self``/``cls`` where the template itself defines
  no ``_x`` outside such inherited names (``parser._actions``, ``strategy._start_method``), a library's private
  name imported and then reached as an attribute (``batchnorm._BatchNorm``) included;
- anywhere: a private key read or written as a string (``ckpt["_class_path"]``, ``.get("_last_lr")``,
  ``key == "_last_lr"``, ``"_x" in state``) that the template does not write itself (a dict literal's key).

What a library object's public attribute is patched with at run time is another question, with its own list:
:func:`run_time_patches`.
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
KEY_METHODS = ("get", "pop", "setdefault")  # mapping methods whose first argument is a key
KEY = re.compile(r"_[A-Za-z]\w*[A-Za-z0-9]")  # a private key: "_last_lr", not a fragment of a name ("_unused_")


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
    def __init__(self, rel: str, module, own: set[str], own_keys: frozenset[str] = frozenset()) -> None:
        self.rel, self.module, self.own, self.own_keys = rel, module, own, own_keys
        self.uses: list[Use] = []
        self.classes: list[frozenset[str]] = []  # the inherited private names of the enclosing classes

    def add(self, node: ast.AST, name: str) -> None:
        self.uses.append(Use(self.rel, node.lineno, name, ast.unparse(node).split("\n")[0][:100]))

    def inherited(self) -> frozenset[str]:
        return self.classes[-1] if self.classes else frozenset()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in LIBRARIES:
                for part in filter(private, parts):
                    self.add(node, part)

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
        if isinstance(func, ast.Attribute) and func.attr in KEY_METHODS and node.args:
            self._key(node, node.args[0])
        self.generic_visit(node)

    def _key(self, node: ast.AST, key: ast.AST) -> None:
        """A string key: a library's private one unless the template writes that key itself."""
        is_key = isinstance(key, ast.Constant) and isinstance(key.value, str) and KEY.fullmatch(key.value)
        if is_key and key.value not in self.own_keys:
            self.add(node, key.value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._key(node, node.slice)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for operand in (node.left, *node.comparators):
            self._key(node, operand)
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
            elif isinstance(node, ast.Import | ast.ImportFrom):
                library = isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] in LIBRARIES
                for alias in node.names:
                    # a library's private name imported here stays the library's; only a local alias is ours
                    own.add(alias.asname or ("" if library else alias.name.partition(".")[0]))
    return {name for name in own | own_keys(trees) if private(name)}


def own_keys(trees: dict[Path, ast.Module]) -> set[str]:
    """Private string keys the scanned code writes itself, as a dict literal's keys: ``{"_step_lock": None}``,
    ``type(name, bases, {"_original_class": cls})``. (An attribute of the template's own named like a library's key,
    ``self._last_lr``, does not make torch's ``"_last_lr"`` key ours.)"""
    keys = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return {key for key in keys if private(key)}


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
        visitor = _Scan(str(path.relative_to(root)), module, own, frozenset(own_keys(trees)))
        visitor.visit(tree)
        uses += visitor.uses
    return sorted(set(uses))


def listed_private_uses(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """The ``PRIVATE_USES`` dict a file assigns at its top level, read from its syntax tree (empty when it has none)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "PRIVATE_USES" for t in targets) and node.value is not None:
            return dict(ast.literal_eval(node.value))
    return {}


def task_private_uses(root: Path, package: str = "app") -> dict[tuple[str, str], tuple[str, str]]:
    """The private uses the tasks under ``root/package`` list for themselves: each sub-package's ``__init__.py`` may
    hold a ``PRIVATE_USES`` of the files in its own folder (the example task's lists its ResNet's); a fork that
    deletes a task deletes its list with it. An entry for a file outside its package is refused: the machinery's
    uses are listed in app/lightning_internals.py."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for init in sorted((root / package).glob("*/__init__.py")):
        folder = init.parent.relative_to(root).as_posix() + "/"
        for (path, name), where in listed_private_uses(init).items():
            if not path.startswith(folder):
                raise ValueError(f"{init.relative_to(root)}: PRIVATE_USES names {path}, which is not in {folder}")
            found[path, name] = where
    return found


# ------------------------------------------------------------------------------------------------ run-time patches
def _patched_classes() -> list[type]:
    """The library objects the template is handed at run time and could patch: the trainer, the module, strategies,
    loggers, callbacks, optimizers and schedulers."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import SaveConfigCallback
    from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy, Strategy
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

    return [
        Trainer, LightningModule, Strategy, DDPStrategy, Logger, CSVLogger, TensorBoardLogger, Callback,
        ModelCheckpoint, SaveConfigCallback, Optimizer, LRScheduler,
    ]  # fmt: skip


def library_members() -> dict[str, str]:
    """Public names those classes define (methods, attributes they set on ``self``), each with the first class that
    has it; properties with a setter are left out (assigning them is their public use)."""
    members: dict[str, str] = {}
    torch_module = set(vars(__import__("torch").nn.Module))  # a module's own state (training, forward...) is not it
    for cls in _patched_classes():
        for base in cls.__mro__:
            if not _library(base) or base.__module__.startswith("torch.nn.modules"):
                continue
            owner = f"{base.__module__}:{base.__qualname__}"
            for name, value in vars(base).items():
                if private(name) or name.startswith("__") or name in torch_module:
                    continue
                if isinstance(value, property) and value.fset is not None:
                    continue
                members.setdefault(name, owner)
            try:
                source = inspect.getsource(base)
            except (OSError, TypeError):
                continue
            for name in re.findall(r"\bself\.([a-z]\w*)\s*(?::[^=\n]*)?=[^=]", source):
                if name not in torch_module and not isinstance(getattr(base, name, None), property):
                    members.setdefault(name, owner)
    return members


CONFIG_NAMES = ("args", "init_args", "config", "trainer_config", "namespace")


def _last_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def run_time_patches(
    root: Path, package: str = "app", skip: tuple[str, ...] = ("lightning_internals.py",)
) -> list[Use]:
    """Every assignment, on an object other than ``self``/``cls``, to a public method or attribute of a library object
    (:func:`library_members`) whose name the template's own classes do not define: a library object patched at run
    time (``logger.log_metrics = counted``, ``trainer.accumulate_grad_batches = 2``), which an upgrade can break
    as silently as a private name."""
    paths = sorted(p for p in (root / package).rglob("*.py") if p.name not in skip)
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    own: set[str] = set()  # attributes the template's own objects set on themselves
    for tree in trees.values():
        for node in ast.walk(tree):
            on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            if on_self and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    members = library_members()
    uses = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                continue
            for target in targets:
                for attribute in ast.walk(target):
                    if not isinstance(attribute, ast.Attribute) or not isinstance(attribute.ctx, ast.Store):
                        continue
                    receiver = attribute.value
                    if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                        continue
                    if _last_name(receiver) in CONFIG_NAMES:  # parsed arguments (a Namespace), not a library object
                        continue
                    if attribute.attr in members and attribute.attr not in own:
                        how = ast.unparse(node).split("\n")[0][:100]
                        uses.append(Use(str(path.relative_to(root)), node.lineno, attribute.attr, how))
    return sorted(set(uses))
