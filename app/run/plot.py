"""``python cli.py plot lightning_logs/version_N``: the task's per-epoch metrics and training samples/s, as a PNG
next to the run.

Reads the run's ``metrics.csv`` (written by the CSV logger), joined to those of the runs it resumed from, and
writes ``plot.png`` in the same folder (``--out`` to choose another path). The panels are the task's
(``TaskSpec.plot_panels``: its class is the one the run's config.yaml names, else ``cli.py``'s default task), then one
per kind of metric that no panel names (:func:`family`: ``loss/train`` and ``val/loss`` together, an accuracy on its
own scale), then training samples/s from 0; a task whose class cannot be imported gets that generic plot of whatever
metrics.csv holds. A value logged per step (``X`` beside ``X_epoch``, the example's ``train/loss``; Lightning's
``X_step``; any value logged more than once an epoch) is drawn faintly on its kind's panel, under the epoch means.
Epochs are numbered as the console and the checkpoints number them (from 0); epoch e's per-step values spread over
e - 0.5 to e + 0.5. A ``cli.py test`` of one of the run's checkpoints (a later ``lightning_logs/version_N`` whose
config names it) is drawn as a dashed line with its score on the panel of the same metric (``test/loss`` on
``val/loss``'s). The title says which data the run trained on (``TaskSpec.data_source``), in red when it was a
stand-in (``TaskSpec.stand_in_data``). Needs matplotlib: ``pip install -e ".[plot]"``.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path

from app.checkpoints.atomic import atomic_path
from app.checkpoints.io import REMOTE_PREFIXES
from app.checkpoints.storage import run_path
from app.errors import UserError
from app.task import TaskSpec, import_class, spec_of

SPEED = ("images/s (training)", ("perf/images_per_s",))  # what the run report logs (app/callbacks/run_report.py)


def _read_rows(metrics_csv: Path) -> list[dict[str, str]]:
    try:
        with metrics_csv.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"{metrics_csv}: not a metrics.csv written by a run ({err})") from None


def _number(metrics_csv: Path, row: dict[str, str], name: str) -> float:
    try:
        return float(row[name])
    except ValueError:
        raise UserError(f"{metrics_csv}: {name}={row[name]!r} is not a number; not a metrics.csv of a run") from None


def run_chain(run_dir: Path) -> list[Path]:
    """The run folders whose checkpoints this run resumed from, oldest first, ending with ``run_dir``.

    A resumed run logs to a folder of its own; its ``config.yaml`` records the checkpoint it started from, and a
    checkpoint in ``version_N/checkpoints/`` belongs to the run in ``version_N``.
    """
    chain = [run_dir]
    while True:
        ckpt = _yaml_of(chain[0] / "config.yaml").get("ckpt_path")
        earlier = None if isinstance(ckpt, str) and ckpt.startswith(REMOTE_PREFIXES) else _owner(ckpt)
        if earlier is None or not (earlier / "metrics.csv").is_file() or earlier in chain:
            return chain
        chain.insert(0, earlier)


def _owner(ckpt) -> Path | None:
    """The run folder of a checkpoint in its ``version_N/checkpoints/``; None for another path, or no path."""
    if not isinstance(ckpt, str) or run_path(ckpt).parent.name != "checkpoints":
        return None
    return run_path(ckpt).parent.parent


def run_rows(run_dir: Path) -> list[tuple[Path, dict[str, str]]]:
    """``(metrics.csv, row)`` of the run and of the runs it resumed from: each earlier run up to the step where the
    next one took over (rows of steps that the next run did again are left out)."""
    rows: list[tuple[Path, dict[str, str]]] = []
    for folder in run_chain(run_dir):
        metrics_csv = folder / "metrics.csv"
        if not metrics_csv.is_file():
            continue
        own = [(metrics_csv, row) for row in _read_rows(metrics_csv)]
        steps = [_number(path, row, "step") for path, row in own if row.get("step")]
        if steps:
            start = min(steps)
            rows = [(path, row) for path, row in rows if not row.get("step") or _number(path, row, "step") < start]
        rows += own
    return rows


SPLIT_WORDS = ("train", "training", "val", "valid", "validation", "test")


def family(name: str) -> str:
    """What a metric measures, its split and Lightning's ``_epoch``/``_step`` suffix left out: ``train/loss_epoch``,
    ``val/loss``, ``loss/train`` and ``val_loss`` are ``loss``; ``score/val`` is ``score``. One family, one scale:
    a panel each (a loss and an accuracy on one axis flattened one of them)."""
    parts = re.split(r"[/_]", name.removesuffix("_epoch").removesuffix("_step"))
    return "/".join(part for part in parts if part.lower() not in SPLIT_WORDS) or name


def step_metrics(run_dir: Path) -> list[str]:
    """The metrics logged per step, as :func:`step_series` draws them: logged more than once in an epoch of one run,
    Lightning's ``X_step`` beside ``X_epoch``, or ``X`` beside ``X_epoch`` (the example's ``train/loss``)."""
    counts: dict[tuple[str, Path, int], int] = defaultdict(int)
    names: set[str] = set()
    for metrics_csv, row in run_rows(run_dir):
        if not row.get("epoch"):
            continue
        epoch = int(_number(metrics_csv, row, "epoch"))
        for name, value in row.items():
            if not value or name in ("epoch", "step") or name.startswith(("lr-", "perf/")):
                continue
            if f"{name}_epoch" in row or (name.endswith("_step") and f"{name.removesuffix('_step')}_epoch" in row):
                names.add(name)
            counts[(name, metrics_csv, epoch)] += 1
            if counts[(name, metrics_csv, epoch)] > 1:
                names.add(name)
    return sorted(names)


def epoch_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(epoch, value), ...]}`` for every per-epoch metric of a run (and the runs it resumed from): the
    metrics a task logs at most once per epoch.

    An epoch logged twice (the interrupted one, then again after the resume) keeps the last value.
    """
    series: dict[str, dict[int, float]] = defaultdict(dict)
    seen: dict[str, set[tuple[Path, int]]] = defaultdict(set)  # (metrics.csv, epoch) pairs that hold a value
    per_step: set[str] = set()
    for metrics_csv, row in run_rows(run_dir):
        if not row.get("epoch"):
            continue
        epoch = int(_number(metrics_csv, row, "epoch"))
        for name, value in row.items():
            # (a value logged per step and per epoch, "X" beside "X_epoch": its steps are drawn under the epochs')
            if not value or name in ("epoch", "step") or f"{name}_epoch" in row or name.startswith("lr-"):
                continue
            if name.endswith("_step") and f"{name.removesuffix('_step')}_epoch" in row:
                continue  # Lightning's per-step half of a value logged per step and per epoch
            if (metrics_csv, epoch) in seen[name]:
                per_step.add(name)  # two values in one epoch of one run: logged per step
            seen[name].add((metrics_csv, epoch))
            series[name][epoch] = _number(metrics_csv, row, name)
    return {name: sorted(values.items()) for name, values in series.items() if name not in per_step}


def panels(
    series: dict[str, list], spec: TaskSpec | None = None, steps: list[str] = ()
) -> list[tuple[str, tuple[str, ...]]]:
    """The task's panels that have data (``spec.plot_panels``), then one panel per :func:`family` of its other
    metrics (per epoch, or per step only: ``steps``), then the training speed."""
    declared = [*(spec.plot_panels if spec else ()), SPEED]
    known = [(title, tuple(names)) for title, names in declared if any(series.get(n) for n in names)]
    others = _undeclared_families(series, {n for _, names in declared for n in names}, steps)
    speed = [panel for panel in known if panel[0] == SPEED[0]]
    return [p for p in known if p not in speed] + [(f, tuple(names)) for f, names in sorted(others.items())] + speed


def _undeclared_families(series: dict[str, list], shown: set[str], steps) -> dict[str, list[str]]:
    """The metrics no declared panel shows, by :func:`family`; a metric logged per step only gets its family too
    (its steps are drawn there)."""
    shown_families = {family(n) for n in shown}
    others: dict[str, list[str]] = defaultdict(list)
    for name in sorted(n for n in series if n not in shown and not n.startswith("perf/") and series[n]):
        others[family(name)].append(name)
    for name in steps:
        if family(name) not in others and family(name) not in shown_families:
            others[family(name)] = []
    return others


def step_series(run_dir: Path, name: str) -> list[tuple[float, float]]:
    """``[(x, value), ...]`` of a value logged per step (the example's ``train/loss``, beside its epoch mean
    ``train/loss_epoch``): epoch e's steps over (e - 0.5, e + 0.5], around the epoch's point."""
    per_epoch: dict[int, dict[int, float]] = defaultdict(dict)
    for metrics_csv, row in run_rows(run_dir):
        if row.get(name) and row.get("epoch") and row.get("step"):
            epoch, step = int(_number(metrics_csv, row, "epoch")), int(_number(metrics_csv, row, "step"))
            per_epoch[epoch][step] = _number(metrics_csv, row, name)
    points = []
    for epoch, losses in sorted(per_epoch.items()):
        steps = sorted(losses)
        points += [(epoch - 0.5 + (i + 1) / len(steps), losses[s]) for i, s in enumerate(steps)]
    return points


def tests_of(run_dir: Path) -> list[tuple[str, str, float]]:
    """``[(metric, label, value), ...]``: the scores of the ``cli.py test`` runs of this run's checkpoints, found as
    the run folders beside it whose ``config.yaml`` names a checkpoint in ``run_dir/checkpoints``."""
    found = []
    for folder in sorted(run_dir.parent.iterdir()):
        ckpt = None if folder == run_dir else _tested_checkpoint(folder, run_dir)
        if ckpt is None:
            continue
        for row in _read_rows(folder / "metrics.csv"):
            for name, value in row.items():
                if name.startswith("test/") and value:
                    found.append((name, f"{name} {float(value):.4f} ({folder.name}: {ckpt.name})", float(value)))
    return found


def _tested_checkpoint(folder: Path, run_dir: Path) -> Path | None:
    """The checkpoint of ``run_dir`` that the run in ``folder`` tested (its config.yaml's ckpt_path), or None."""
    if not (folder / "config.yaml").is_file() or not (folder / "metrics.csv").is_file():
        return None
    ckpt = _yaml_of(folder / "config.yaml").get("ckpt_path")
    owner = _owner(ckpt)
    if owner is None or owner.is_absolute() and owner.resolve() != run_dir.resolve() or owner.name != run_dir.name:
        return None
    return run_path(ckpt)


def _yaml_of(path: Path) -> dict:
    """A run's YAML file as a dict; empty when it is missing or not a mapping."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def task_spec(run_dir: Path, model: str | type | None = None) -> TaskSpec | None:
    """The spec of the task the run trained: the class its config.yaml names (``--model=pkg.Class``), else ``model``
    (the default task, which a run of it does not name); None when there is none or it cannot be imported (a generic
    plot then)."""
    config = _yaml_of(run_dir / "config.yaml").get("model")
    named = (config.get("class_path") if isinstance(config, dict) else None) or model
    try:
        return spec_of(import_class(named) if isinstance(named, str) else named) if named else None
    except Exception:  # noqa: BLE001  (any failure to import a task's class: the plot needs no task)
        return None


def data_source(run_dir: Path, spec: TaskSpec | None = None) -> str | None:
    """The data the run trained on (the ``hparams.yaml`` value the task's ``spec.data_source`` names), or None."""
    if spec is None or not spec.data_source:
        return None
    value = _yaml_of(run_dir / "hparams.yaml").get(spec.data_source)
    return None if value is None else str(value)


def _refuse_a_test_run(run_dir: Path) -> None:
    """A folder of ``cli.py test`` (its metrics.csv holds only ``test/*`` values) has no curve to draw: one line naming
    the training run whose plot shows its score (before: two dots on an epoch axis around 0, exit 0)."""
    rows = _read_rows(run_dir / "metrics.csv")
    names = {name for row in rows for name, value in row.items() if value and name not in ("epoch", "step")}
    if not names or not all(name.startswith("test/") for name in names):
        return
    ckpt = _yaml_of(run_dir / "config.yaml").get("ckpt_path")
    if (owner := _owner(ckpt)) is not None:
        raise UserError(
            f"{run_dir} holds a `cli.py test` of {ckpt}, not a training run: plot the run that trained it, "
            f"`cli.py plot {owner}` (its figure marks this score)"
        )
    raise UserError(f"{run_dir} holds a `cli.py test` run, not a training run: plot the run folder of a `fit`")


def figure(run_dir: str | Path, model: str | type | None = None):
    """The run's figure (a matplotlib ``Figure``): the task's panels (``model``: the default task's class, for a run
    whose config names none) and the speed, titled with its data."""
    run_dir = run_path(run_dir)
    metrics_csv = run_dir / "metrics.csv"
    if not metrics_csv.is_file():
        raise UserError(f"{metrics_csv}: not found; give a run folder such as lightning_logs/version_0")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        project = Path(__file__).resolve().parents[2]
        raise UserError(f'plot needs matplotlib: {sys.executable} -m pip install -e "{project}[plot]"') from None
    _refuse_a_test_run(run_dir)
    series = epoch_metrics(run_dir)
    spec = task_spec(run_dir, model)
    steps = step_metrics(run_dir)
    layout = panels(series, spec, steps)
    if not layout:
        raise UserError(f"{metrics_csv}: no per-epoch metrics yet (has an epoch finished?)")
    tested = tests_of(run_dir)
    fig, axes = plt.subplots(1, len(layout), figsize=(5 * len(layout), 3.8), constrained_layout=True, squeeze=False)
    for ax, (title, names) in zip(list(axes[0]), layout, strict=True):
        draw_panel(ax, title, names, run_dir, series, steps, tested)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    source = data_source(run_dir, spec)
    if spec is not None and source in spec.stand_in_data:
        fig.suptitle(
            f"{run_dir}  —  {source.upper()} stand-in data: these scores say nothing about the real data", color="red"
        )
    else:
        fig.suptitle(f"{run_dir}  —  data: {source}" if source else str(run_dir))
    return fig


def draw_panel(ax, title: str, names: tuple[str, ...], run_dir: Path, series: dict, steps, tested: list) -> None:
    """One panel: its per-step values faint, its per-epoch values with markers, the test scores of its metrics as
    dashed lines."""
    families = {family(name) for name in names} or {title}
    for each_step in (name for name in steps if family(name) in families):
        if points := step_series(run_dir, each_step):
            faint = {"color": "0.6", "linewidth": 0.8, "alpha": 0.6}
            ax.plot(*zip(*points, strict=True), **faint, label=f"{each_step} (per step)")
    for name in names:
        if series.get(name):
            ax.plot(*zip(*series[name], strict=True), marker="o", label=name)
    panel_metrics = {name.rpartition("/")[2].removesuffix("_epoch") for name in names}
    for metric, label, value in tested:
        if metric.removeprefix("test/") in panel_metrics:
            ax.axhline(value, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_title(title)
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    if title == SPEED[0]:
        ax.set_ylim(bottom=0)  # speed from 0: run-to-run noise is not a trend


def plot_run(run_dir: str | Path, out: str | Path | None = None, model: str | type | None = None) -> Path:
    """Draw :func:`figure` into ``out`` (default ``RUN_DIR/plot.png``), atomically; returns the path written."""
    out = run_path(out) if out else run_path(run_dir) / "plot.png"
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name such as {out / 'plot.png'}")
    fig = figure(run_dir, model)
    import matplotlib.pyplot as plt

    try:
        with atomic_path(out, suffix=".png") as partial:  # savefig picks the format by the suffix
            fig.savefig(partial, dpi=100)
    except OSError as err:
        raise UserError(f"--out {out}: cannot write it ({err.strerror})") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str], model: str | type | None = None) -> None:
    """``cli.py plot``; ``model``: ``cli.py``'s default task (class path or class), for runs whose config names none."""
    parser = argparse.ArgumentParser(prog="cli.py plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run folder, e.g. lightning_logs/version_0")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.run_dir, args.out, model)}", file=sys.stderr)
