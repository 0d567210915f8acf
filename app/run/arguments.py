"""The command line's own parsing: one-line errors instead of jsonargparse's usage and union walls (the closest flag,
the choices, the file that holds a mistyped key), --config files checked as YAML, and a strategy's options
accepted after its short name.

The one-line errors are rewritten from the text of jsonargparse's messages, which no API promises: setup.cfg bounds
jsonargparse below its next major version, and the tests that provoke each kind of message through ``cli.py`` and
check the line a user sees (tests/test_cli.py: test_a_wrong_option_of_a_strategy_or_callback_is_one_plain_line, the
typo and YAML tests, and the example task's CLI tests) are the contract: a jsonargparse that words a message
differently fails them by name."""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from app.errors import UserError
from app.task import import_class

CKPT_PATH_HELP = (
    "Checkpoint to start from: a file (lightning_logs/version_N/checkpoints/last.ckpt, or another .ckpt there), "
    "'last' (the newest last.ckpt of a run with this command's settings, else the newest of all; fit starts fresh "
    "when there is none) or 'best' (the best checkpoint of that run). The checkpoint's network settings (those the "
    "task's spec.network names) are used."
)


def nested_option_error(line: str) -> str | None:
    """jsonargparse's union error for an option of a class given by name or class path (``--trainer.strategy.op``,
    ``--trainer.callbacks.hook``), or under its ``init_args`` in a YAML file, as one sentence: the flag or the YAML
    key, what is wrong, and the choices or the closest option."""
    flag, key = _nested_flag(line)
    if flag is None:
        return None
    problem = re.search(
        rf"Problem with given class_path '([\w.]+)': (?:Parser key \"{re.escape(key)}\": (.*?)(?= - |$)|"
        rf"(Option '{re.escape(key)}' is not accepted))",
        line,
    )
    if problem is None:
        return None
    class_path, wrong_value, unknown = problem.groups()
    if unknown:
        flag = flag if flag.startswith("--") else flag.split(": ")[0]  # a YAML key: its value says nothing here
        parameters = inspect.signature(import_class(class_path).__init__).parameters
        options = [p for p in parameters if p not in ("self", "args")]
        close = difflib.get_close_matches(key, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"{flag}: {class_path.rsplit('.', 1)[1]} has no option {key!r}{hint}; its options: {', '.join(options)}"
    return f"{flag}: {_wrong_value(wrong_value)}"


def _nested_flag(line: str) -> tuple[str | None, str | None]:
    """The flag (``--trainer.strategy.op=x``) or YAML key (``trainer.strategy.init_args.op: x``) of a nested option's
    union error, and the option's name; ``(None, None)`` for another error."""
    group = re.search(r'Parser key "([\w.]+)": Does not validate against any of the Union subtypes', line)
    if group is None:
        return None, None
    # the value as jsonargparse parsed it: a string in quotes, or a list (--trainer.strategy.balance=[a,b])
    given = re.search(r"NestedArg\(key='([\w.]+)', val=('[^']*'|.*?)\)(?= |$)", line)
    if given:
        key, value = given.groups()
        return f"--{group.group(1)}.{key}={value[1:-1] if value.startswith(chr(39)) else value}", key
    # a YAML file's class_path and init_args: the key with its file's path (Parser.error adds the file)
    key, value = _yaml_init_arg(line)
    if key is None:
        return None, None
    return f"{group.group(1)}.init_args.{key}" + (f": {value}" if value is not None else ""), key


def _wrong_value(wrong_value: str) -> str:
    """What jsonargparse says of a nested option's value, as what it must be."""
    choices = re.search(r"Expected a typing\.Literal\[(.*?)\]", wrong_value)
    if choices:
        return f"must be one of {', '.join(c.strip().strip(chr(39)) for c in choices.group(1).split(','))}"
    plain = re.match(r"Expected a (<class '(?:int|float|bool)'>)\. Got value:", wrong_value)
    if plain:
        return f"expected {plain_types([plain.group(1)])}"
    # an option that may also be left unset (reduce_dtype: Literal[...] | None, stages: int | None): a union
    subtypes = re.search(r"Subtypes: \[(.*?)\] Errors:", wrong_value)
    expected = expectation(subtypes.group(1)) if subtypes else None
    return expected or wrong_value.split(" Given value type:")[0].strip()


def _yaml_init_arg(line: str) -> tuple[str | None, object]:
    """The init_args key that jsonargparse's union error about a YAML mapping names, and its value there."""
    import ast

    key = re.search(
        r"Problem with given class_path '[\w.]+': (?:Parser key \"(\w+)\"|Option '(\w+)' is not accepted)", line
    )
    given = re.search(r"Given value type: <class 'dict'> Given value: (\{.*\})", line)
    if key is None:
        return None, None
    name = key.group(1) or key.group(2)
    try:
        init_args = ast.literal_eval(given.group(1)).get("init_args", {}) if given else {}
    except (ValueError, SyntaxError):
        init_args = {}
    return name, init_args.get(name) if isinstance(init_args, dict) else None


PLAIN_TYPES = {"<class 'int'>": "a whole number", "<class 'float'>": "a number", "<class 'bool'>": "true or false"}


def plain_types(types: list[str]) -> str:
    """``["<class 'int'>", "<class 'float'>"]`` -> "a number" (a whole number is a number too)."""
    if "<class 'float'>" in types:
        types = [t for t in types if t != "<class 'int'>"]
    return " or ".join(PLAIN_TYPES[t] for t in types)


def union_error(line: str) -> str | None:
    """jsonargparse's union error for a value that fits none of an option's types, as one sentence: the choices
    when the types are literals (``--trainer.precision``), the closest class when a class path names none."""
    key = re.search(r'Parser key "([\w.]+)":', line)
    if key is None:
        return None
    flag = f"--{key.group(1)}"
    missing = re.search(r"Problem with given class_path '([\w.]+)': module '([\w.]+)' has no attribute '(\w+)'", line)
    if missing:
        _, module, name = missing.groups()
        try:
            names = [n for n, v in vars(importlib.import_module(module)).items() if isinstance(v, type)]
        except ImportError:
            names = []
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f" (did you mean {module}.{close[0]}?)" if close else ""
        return f"{flag}: {module} has no class {name!r}{hint}"
    one = re.search(r"Expected a typing\.Literal\[(.*?)\]\. Got value: (.*?)(?:; see:|$)", line)
    if one:
        choices = [c.strip().strip("'") for c in one.group(1).split(",")]
        return f"{flag}={one.group(2)}: must be one of {', '.join(choices)}"
    one = re.search(r"Expected a (<class '(?:int|float|bool)'>)\. Got value: (.*?)(?:; see:|$)", line)
    if one:
        return f"{flag}={one.group(2)}: expected {plain_types([one.group(1)])}"
    subtypes = re.search(r"Subtypes: \[(.*?)\] Errors:", line)
    given = re.search(r"Given value: (.*)$", line)
    if not (subtypes and given):
        return None
    value = given.group(1).split(";")[0].strip()
    expected = expectation(subtypes.group(1))
    return f"{flag}={value}: {expected}" if expected else None


LIST_TYPES = {"list[int]": "a list of whole numbers", "list[float]": "a list of numbers", "list[str]": "a list"}


def _expected_kinds(types: list[str]) -> str:
    """``expected a whole number or a list of numbers``: what plain and list types ask for."""
    plain = [t for t in types if t in PLAIN_TYPES]
    kinds = ([plain_types(plain)] if plain else []) + [LIST_TYPES[t] for t in types if t in LIST_TYPES]
    return f"expected {' or '.join(kinds)}"


def expectation(subtypes: str) -> str | None:
    """What a value must be, from the ``Subtypes: [...]`` of jsonargparse's union error: "must be one of ..." when
    the types are literals, "expected a whole number" (or a list of them) for plain types; None for others (classes).
    ``None`` among them (an option that may be left unset) goes unsaid."""
    types = re.findall(r"typing\.Literal\[[^\]]*\]|<class '[\w.]+'>|[\w.\[\], ]+?(?=, typing|, <class|$)", subtypes)
    types = [t.strip() for t in types if t.strip() != "<class 'NoneType'>"]
    if not types:
        return None
    if all(t in PLAIN_TYPES or t in LIST_TYPES for t in types):  # --trainer.max_epochs=abc
        return _expected_kinds(types)
    if not all(t.startswith("typing.Literal[") for t in types):
        return None
    found = (c[0] or c[1] for t in types for c in re.findall(r"'([^']*)'|(-?\d+)", t.removeprefix("typing.Literal[")))
    return f"must be one of {', '.join(dict.fromkeys(found))}"


# An optimizer's arguments, given as --model.lr: they are --model.optimizer.lr.
OPTIMIZER_ARGS = {"lr", "momentum", "weight_decay", "nesterov", "betas", "eps", "dampening", "amsgrad"}


class Parser(LightningArgumentParser):
    """Parse errors as one line (no 70-line usage), with the closest flag when one was mistyped."""

    config_files: dict[Path, object] = {}  # the --config files of this command line, as read (check_config_files)

    @override
    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = " ".join(message.split())
        unknown = re.findall(r"(--[\w.\-]+)", line) if "nrecognized" in line else []
        # a key of a YAML config: "... does not accept option 'trainer.max_epoch'"
        unknown += ["--" + key for key in re.findall(r"does not accept option '([\w.\-]+)'", line)]
        line += closest_flag(
            unknown, [o for a in parser._actions for o in a.option_strings if o.startswith("--")], line
        )
        holder = next(filter(None, (self._file_holding(flag[2:]) for flag in unknown)), None)
        if holder is not None and str(holder) not in line:  # a key of a YAML config: which file holds it
            line = f"{holder}: {line}"
        nested = nested_option_error(line)
        if nested and not nested.startswith("--"):  # a key of a YAML file: which file holds it
            nested = self._in_its_file(nested)
        line = nested or union_error(line) or line
        raise UserError(f"{line}; see: python {typed_prog(parser)} --help")

    def _in_its_file(self, line: str) -> str:
        """``line`` about a YAML key (``trainer.strategy.init_args.op: x``) with the --config file that holds it."""
        holder = self._file_holding(line.split(":")[0])
        return f"{holder}: {line}" if holder is not None else line

    def _file_holding(self, key: str) -> Path | None:
        """The --config file of this command line that holds ``key`` (``trainer.max_epoch``), or None."""
        return next((path for path, data in self.config_files.items() if has_key(data, key)), None)

    @override
    def add_method_arguments(self, *args, **kwargs):
        """The subcommands' arguments (``--ckpt_path`` among them, whose help is ours)."""
        added = super().add_method_arguments(*args, **kwargs)
        for action in self._actions:
            if action.dest == "ckpt_path":
                action.help = CKPT_PATH_HELP
        return added


def typed_prog(parser) -> str:
    """The command as the user typed it (``cli.py fit``; from another folder, the script's path)."""
    prog = parser.prog.replace(" [options]", "")
    script, _, rest = prog.partition(" ")
    return f"{sys.argv[0]} {rest}".strip() if Path(sys.argv[0]).name == script else prog


def closest_flag(unknown: list[str], flags: list[str], line: str) -> str:
    """`` (did you mean --trainer.max_epochs?)`` for the first unknown flag close to a known one, else ``""``."""
    for flag in unknown:
        # not a group the flag is inside of (--model for --model.lr); an optimizer's argument is under the optimizer
        candidates = [f for f in flags if not flag.startswith(f + ".")]
        close = difflib.get_close_matches(flag, candidates, n=1, cutoff=0.75)
        if flag.startswith("--model.") and flag.count(".") == 1 and flag[8:] in OPTIMIZER_ARGS:
            close = [f"--model.optimizer.{flag[8:]}"]
        if close:
            return f" (did you mean {close[0] if flag in line else close[0][2:]}?)"
    return ""


def check_config_files(argv: list[str]) -> None:
    """A ``--config`` file that is not valid YAML: name the file and the line (jsonargparse names neither). The files
    read are kept for :class:`Parser`'s errors, which name the file of a mistyped key."""
    paths = [b for a, b in zip(argv, argv[1:], strict=False) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-c="))]
    Parser.config_files = {}
    for path in map(Path, paths):
        if not path.exists() and _names_a_file(str(path)):
            raise UserError(f"--config {path}: no such file; check the path (the presets are in configs/)")
        if path.is_dir():
            raise UserError(f"--config {path}: is a folder; pass a YAML file")
        if path.is_file():
            try:
                Parser.config_files[path] = yaml.safe_load(path.read_text())
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                raise UserError(f"{path}: not valid YAML ({where.strip()} {problem}); fix the file") from None


def _names_a_file(value: str) -> bool:
    """Whether a ``--config`` value is meant as a file's path: jsonargparse also takes the YAML itself in its place
    (``--config '{trainer: {max_epochs: 1}}'``)."""
    try:
        return not isinstance(yaml.safe_load(value), dict)
    except yaml.YAMLError:
        return True


def has_key(data: object, dotted: str) -> bool:
    """Whether the YAML ``data`` holds ``dotted`` (``trainer.max_epoch``), at its top or under a subcommand's key."""
    if isinstance(data, dict) and any(has_key(data.get(sub), dotted) for sub in LightningCLI.subcommands()):
        return True
    return _holds(data, dotted.split("."))


def _holds(data: object, keys: list[str]) -> bool:
    if not keys:
        return True
    if isinstance(data, list):  # a callbacks: list: any of its entries
        return any(_holds(item, keys) for item in data)
    return isinstance(data, dict) and keys[0] in data and _holds(data[keys[0]], keys[1:])


def flag_values(argv: list[str], flag: str) -> Iterator[tuple[int, int, str]]:
    """``(i, at, value)`` for each ``flag=value`` (``at == i``) or ``flag value`` (``at == i + 1``) in ``argv``."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"{flag}="):
            yield i, i, arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(argv):
            yield i, i + 1, argv[i + 1]


def strategy_options_by_name(argv: list[str]) -> list[str]:
    """``--trainer.strategy=horovod --trainer.strategy.op=adasum`` works: jsonargparse takes a strategy's options
    only after its class path, so a registered name followed by options is replaced by its class path (and the
    registry's preset options for that name, which the user's own options then override)."""
    if not any(a.startswith("--trainer.strategy.") for a in argv):
        return argv
    from lightning.pytorch.strategies import StrategyRegistry

    out = list(argv)
    for i, at, name in flag_values(argv, "--trainer.strategy"):
        # the registry's .get() builds the strategy; the entry itself is what is wanted here
        entry = StrategyRegistry[name] if name in StrategyRegistry else None  # noqa: SIM401
        presets = entry["init_params"] if entry else {}
        if entry is None or not all(isinstance(v, str | int | float | bool) for v in presets.values()):
            continue
        cls = entry["strategy"]
        class_path = f"{cls.__module__}.{cls.__qualname__}"
        out[at] = f"--trainer.strategy={class_path}" if at == i else class_path
        out[at + 1 : at + 1] = [f"--trainer.strategy.{k}={_yaml_value(v)}" for k, v in presets.items()]
        return out
    return argv


def strategy_class(strategy) -> type | None:
    """The class a ``--trainer.strategy`` value names (a registered name, or a class path with its init_args), or
    None for ``auto`` and what names no class."""
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    if isinstance(strategy, Strategy):
        return type(strategy)
    if isinstance(strategy, str):
        return StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    class_path = getattr(strategy, "class_path", None) or (
        strategy.get("class_path") if isinstance(strategy, dict) else None
    )
    if not class_path:
        return None
    try:
        return import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return None


def _yaml_value(value: str | int | float | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


TIMEOUT_FLAG = "--trainer.strategy.timeout"
TIMEOUT_HINT = "use a finite duration > 0, in seconds (600) or as H:MM:SS (0:10:00)"


def timeout_in_seconds(argv: list[str]) -> list[str]:
    """``--trainer.strategy.timeout`` (the process group's timeout, a ``timedelta``) also in seconds: ``=600`` is
    ``=0:10:00``. A duration that is not above zero is one line: torch took it and failed in C++ at the first
    collective, a hundred lines of frames.

    Why a rewrite of this one flag and not ``jsonargparse.typing.register_type(timedelta, deserializer=...)``, which
    would take seconds in a YAML file too (tried with jsonargparse 4.53): the registration replaces jsonargparse's
    own ``timedelta`` deserializer process-wide, for every class a run configures (a fork's, Lightning's
    ``ModelCheckpoint(train_time_interval=...)``), and its failures come back as jsonargparse's multi-line
    "Not of type timedelta" error rather than this one line."""
    out = list(argv)
    for i, at, value in flag_values(argv, TIMEOUT_FLAG):
        try:
            seconds = float(value)
        except ValueError:
            continue  # H:MM:SS: jsonargparse reads it, check_timeout checks it
        if not math.isfinite(seconds) or seconds <= 0:
            raise UserError(f"{TIMEOUT_FLAG}={value}: {TIMEOUT_HINT}")
        duration = str(timedelta(seconds=seconds))
        out[at] = f"{TIMEOUT_FLAG}={duration}" if at == i else duration
    return out


def check_timeout(strategy) -> None:
    """The process group's timeout, however it was given (a flag, a YAML file): above zero."""
    init_args = getattr(strategy, "init_args", None) or (
        strategy.get("init_args") if isinstance(strategy, dict) else None
    )
    timeout = init_args.get("timeout") if init_args is not None and hasattr(init_args, "get") else None
    if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
        raise UserError(f"{TIMEOUT_FLAG}={timeout}: {TIMEOUT_HINT}")


def raised_by_a_class(err: BaseException) -> BaseException | None:
    """The exception a class's own ``__init__`` raised while the parser built it (a task's ``ValueError``), with its
    traceback from the first frame outside the parser on; None for any other error.

    jsonargparse tries each type a value may have and reports what each one said inside an error of its own, the
    class's exception as its ``__cause__``: about 70 lines of the parser's frames around the task's two. Raised again
    from here, a person sees the frames of their own code and their own message, as Python shows any error."""
    import jsonargparse
    from lightning.pytorch import cli

    cause = err.__cause__
    if not isinstance(err, ValueError) or cause is None or cause.__traceback__ is None:
        return None
    parser = (str(Path(jsonargparse.__file__).parent), str(Path(cli.__file__)))
    tb = cause.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(parser):
        tb = tb.tb_next
    return None if tb is None else cause.with_traceback(tb)
