"""Where a compiled step loses its CUDA graphs: the plain loop and ``cli.py fit``, step by step, with torch's own logs.

    python -m bench.cudagraphs --arch resnet18 --batch-size 256 --precision bf16-mixed --channels-last \\
        --compile-mode reduce-overhead --steps 60            # one GPU: four fresh processes, about 3 minutes

On one H200 the plain loop ran 0.80 s per epoch under ``reduce-overhead`` and ``cli.py fit`` 5.08 s (issue 44): this
probe says why, in one command. Each variant runs in a fresh process on the same network, batch, data and precision:

- ``plain``: ``bench/plain.py``'s loop, compiled the same way;
- ``cli``: ``cli.py fit`` as users run it (every default callback, the loggers, checkpoints);
- ``baseline``: the same with another checkout's ``cli.py`` (``--baseline DIR``): before and after a change, in one run;
- ``lightning``: ``cli.py fit`` with every default callback, the loggers and checkpoints off: Lightning alone;
- ``@STRATEGY`` after ``cli`` or ``baseline``: with ``--trainer.strategy=STRATEGY`` on the one device (``cli@ddp``);
- ``+mark`` after any of them: ``torch.compiler.cudagraph_mark_step_begin()`` at the start of every training step
  (:class:`StepMarks` in the ``cli.py`` runs). On an H200 it made Lightning's steps slower (16.0 ms of host time
  against 5.0), so the template does not mark steps.
- ``+device`` after any of them: the training set held on the device and each batch cut there (``cli.py``'s
  ``--data.on_device=true``, the plain loop's ``--data-on-device``): no pinned batch, no copy per step.
- ``+profile`` after a ``cli.py`` variant: the timed epoch under ``cProfile`` (:class:`StepProfile`); where the host's
  time goes, written beside the logs as ``<variant>.profile.txt`` (the step times of that variant include the
  profiler's own cost).
- ``+fused`` after any of them: SGD's fused implementation (``fused=True``: one kernel for the whole update instead
  of a few ``foreach`` launches per step), in the plain loop and through ``--model.optimizer.init_args.fused=true``;
- ``+actions`` after a ``cli.py`` variant: the run under :class:`bench.host_overhead.StepActions`, Lightning's
  profiler interface timing each action it names (each hook of each callback, the module's hooks, the strategy's
  step, backward, the fetch of the next batch): own host microseconds per step over the timed epoch, written beside
  the logs as ``<variant>.actions.json`` (about 0.5 us of its own per action);
- ``+kernels`` after any of them: steps 10 to 40 of the timed epoch under ``torch.profiler`` with CUDA's
  synchronisation checks on (:class:`KernelProfile`): kernels and kernel time per step, the host's waits for the
  device (``cudaStreamSynchronize`` and the like) and the lines that caused them
  (``torch.cuda.set_sync_debug_mode("warn")``), the top kernels, written as ``<variant>.kernels.txt``; what differs
  between two variants on the device, where the step times alone do not say (their times include the profiler's).

For each: the per-step median, p90 and max of the host time (between step starts, ``perf_counter``) and of the
device time (CUDA events around each step, read after the run: nothing waits inside it), over the steps after the
warm-up; the graphs Dynamo compiled, its recompiles and graph breaks (its counters); and the lines of
``TORCH_LOGS=+cudagraphs,recompiles,graph_breaks,perf_hints`` that name each mechanism: graphs recorded, re-recorded
(with their reasons), warm-up and eager runs of the tree, skipped graphs, recompiles, graph breaks, perf hints. The
logs are kept beside the results. Writes ``bench/results/cudagraphs-<arch>-b<batch>[-<mode>]-<device>.{json,md}``.

On CPU (``--device cpu``, default compile mode or ``--no-compile``) it checks that the probe itself works.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import torch
from lightning.pytorch import Callback

from bench.report import RESULTS, record

ROOT = Path(__file__).resolve().parents[1]
TORCH_LOGS = "+cudagraphs,recompiles,graph_breaks,perf_hints"
# What each counted log line says (torch 2.11-2.15: torch/_inductor/cudagraph_trees.py, cudagraph_utils.py, dynamo)
MECHANISMS = {
    "recorded": r"\bRecording function=",
    "re-recorded": r"\bRe-recording function=",
    "warm-up runs": r"\bRunning warmup function=",
    "eager runs": r"\bRunning eager function=",
    "skipped graphs": r"skipping cudagraphs due to",
    "recompiles": r"\bRecompiling function\b",
    "graph breaks": r"\bGraph break",
}
STEP_TIMES = "BENCH_STEP_TIMES"  # where StepTimes writes (an environment variable: cli.py's callbacks take no path)
PROFILE = "BENCH_PROFILE"  # where StepProfile writes
ACTIONS = "BENCH_ACTIONS"  # where bench.host_overhead.StepActions writes
KERNELS = "BENCH_KERNELS"  # where KernelProfile writes (JSON, and the tables beside it as .txt)
# The CUDA runtime calls in which the host waits for the device
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaStreamWaitEvent")


# ------------------------------------------------------------------------------------------------ in the runs
class StepTimer:
    """Host and device time of each training step, with no synchronisation inside the run."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.starts: list[float] = []
        self.events: list[tuple] = []

    def start(self) -> None:
        self.starts.append(time.perf_counter())
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self.events.append((begin, torch.cuda.Event(enable_timing=True)))

    def end(self) -> None:
        if self.cuda and self.events:
            self.events[-1][1].record()

    def write(self, path: str | os.PathLike, skip: int) -> None:
        """The steps after the first ``skip`` (warm-up, compilation), as milliseconds."""
        if self.cuda:
            torch.cuda.synchronize()
        host = [(b - a) * 1e3 for a, b in zip(self.starts, self.starts[1:], strict=False)][skip:]
        device = [begin.elapsed_time(end) for begin, end in self.events][skip:] if self.cuda else []
        # the device's step-to-step time: a step's own work plus any wait for the host (what throughput sees)
        begins = [begin for begin, _ in self.events][skip:] if self.cuda else []
        period = [a.elapsed_time(b) for a, b in zip(begins, begins[1:], strict=False)]
        steps = {"host_ms": host, "device_ms": device, "period_ms": period, "dynamo": dynamo_counters()}
        Path(path).write_text(json.dumps(steps))


def dynamo_counters() -> dict:
    """Dynamo's and inductor's counters (torch's internals, read for the bench only)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return {}
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_recorded_non_static_inputs": counters["inductor"]["cudagraph_recorded_non_static_inputs"],
    }


class StepTimes(Callback):
    """``cli.py fit``'s steps, timed as :class:`StepTimer` does; the last epoch's are written to ``$BENCH_STEP_TIMES``
    when training ends."""

    def __init__(self) -> None:
        self._timer: StepTimer | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._timer = StepTimer(pl_module.device)  # the last epoch's steps: compiled and warm

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._timer.end()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and os.environ.get(STEP_TIMES):
            self._timer.write(os.environ[STEP_TIMES], skip=0)


class StepMarks(Callback):
    """``torch.compiler.cudagraph_mark_step_begin()`` before every training step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        torch.compiler.cudagraph_mark_step_begin()


class StepProfile(Callback):
    """The last training epoch under ``cProfile``; the top functions by own and by cumulative time are written to
    ``$BENCH_PROFILE`` when it ends, and the whole profile beside it (``.prof``)."""

    def __init__(self) -> None:
        self._profile = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1:
            import cProfile

            self._profile = cProfile.Profile()
            self._profile.enable()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._profile is None:
            return
        self._profile.disable()
        import io
        import pstats

        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(self._profile, stream=text).sort_stats(key).print_stats(35)
        Path(os.environ[PROFILE]).write_text(text.getvalue())
        self._profile.dump_stats(Path(os.environ[PROFILE]).with_suffix(".prof"))  # whole, for pstats to compare
        self._profile = None


class KernelProfile:
    """Some steps under ``torch.profiler`` (CPU and CUDA) and ``torch.cuda.set_sync_debug_mode("warn")``: per step,
    the kernels launched and their time on the device, the runtime calls that made the host wait (:data:`WAITS`), the
    copies, and the Python lines whose tensor reads synchronised; the top kernels and host calls as tables."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.steps = 0
        self._profiler = None
        self._warnings = None
        self._caught: list = []

    def start(self) -> None:
        import warnings

        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def step(self) -> None:
        self.steps += self._profiler is not None

    def stop(self) -> None:
        if self._profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        self._warnings.__exit__(None, None, None)
        events = self._profiler.key_averages()
        self._profiler = None
        steps = max(self.steps, 1)

        def device_us(event) -> float:
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0

        # what ran on the device, less the ranges named in Python ("Optimizer.step#SGD.step", whose device time spans
        # Lightning's whole closure: forward and backward)
        on_device = [
            e
            for e in events
            if device_us(e) > 0
            and "cuda" in str(getattr(e, "device_type", "")).lower()
            and not (getattr(e, "is_user_annotation", False) or "#" in e.key)
        ]
        kernels = [e for e in on_device if not e.key.startswith("Memcpy") and not e.key.startswith("Memset")]
        sites = Counter(
            f"{Path(w.filename).name}:{w.lineno}" for w in self._caught if "synchronizing" in str(w.message).lower()
        )
        summary = {
            "steps": self.steps,
            "kernels per step": round(sum(e.count for e in kernels) / steps, 1),
            "kernel ms per step": round(sum(device_us(e) for e in kernels) / steps / 1e3, 3),
            "copies per step": {e.key: round(e.count / steps, 2) for e in on_device if e.key.startswith("Memcpy")},
            "waits per step": {e.key: round(e.count / steps, 2) for e in events if e.key in WAITS},
            "sync sites per step": {site: round(n / steps, 2) for site, n in sites.most_common(8)},
        }
        self.path.write_text(json.dumps(summary))
        sort = "self_cuda_time_total"
        tables = []
        for key, title in ((sort, "kernels by device time"), ("self_cpu_time_total", "host calls by own time")):
            try:
                tables.append(f"## {title}\n{events.table(sort_by=key, row_limit=25, max_name_column_width=70)}")
            except (AttributeError, KeyError, ValueError):  # a torch that names the device column otherwise
                tables.append(f"## {title}\n{events.table(sort_by='self_device_time_total', row_limit=25)}")
        self.path.with_suffix(".txt").write_text(f"{json.dumps(summary, indent=1)}\n\n" + "\n\n".join(tables))


class StepKernels(Callback):
    """Steps 10 to 40 of the last training epoch under :class:`KernelProfile`, written to ``$BENCH_KERNELS``."""

    FIRST, LAST = 10, 40

    def __init__(self) -> None:
        self._kernels = KernelProfile(os.environ.get(KERNELS, "kernels.json"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1 and batch_idx == self.FIRST:
            self._kernels.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._kernels.step()
        if batch_idx == self.LAST - 1:
            self._kernels.stop()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._kernels.stop()  # an epoch shorter than LAST steps


# ------------------------------------------------------------------------------------------------ the variants
def command(variant: str, args, data_dir: Path) -> list[str]:
    variant, *flags = variant.split("+")
    mark, profile, on_device, kernels = "mark" in flags, "profile" in flags, "device" in flags, "kernels" in flags
    fused, actions = "fused" in flags, "actions" in flags
    base, _, strategy = variant.partition("@")
    if base == "plain":
        cmd = [
            sys.executable, "-m", "bench.plain", f"--arch={args.arch}", f"--batch-size={args.batch_size}",
            f"--steps={args.steps}", f"--precision={args.precision}", f"--data-dir={data_dir}",
            f"--source={args.source}", f"--device={args.device}",
            "--channels-last" if args.channels_last else "--no-channels-last",
            "--compile" if args.compile else "--no-compile", f"--compile-mode={args.compile_mode}",
        ]  # fmt: skip
        cmd += ["--kernels"] if kernels else []
        cmd += ["--fused-optimizer"] if fused else []
        return cmd + (["--mark-steps"] if mark else []) + (["--data-on-device"] if on_device else [])
    accelerator = "gpu" if args.device.startswith("cuda") else "cpu"
    cmd = [
        sys.executable, str((args.baseline if base == "baseline" else ROOT) / "cli.py"), "fit",
        f"--model.arch={args.arch}", f"--data.batch_size={args.batch_size}", f"--data.data_dir={data_dir}",
        f"--data.source={args.source}", f"--trainer.accelerator={accelerator}", "--trainer.devices=1",
        "--trainer.max_epochs=2", f"--trainer.limit_train_batches={args.steps}", "--trainer.limit_val_batches=5",
        "--trainer.num_sanity_val_steps=0", f"--model.channels_last={args.channels_last}",
        f"--model.compile={args.compile}", f"--model.compile_mode={args.compile_mode}",
        "--trainer.callbacks+=bench.cudagraphs.StepTimes",
    ]  # fmt: skip
    if args.precision != "32":
        cmd.append(f"--trainer.precision={args.precision}")
    if strategy:
        cmd.append(f"--trainer.strategy={strategy}")
    if base == "lightning":  # Lightning alone: no default callback, logger, checkpoint, bar or summary
        from app.run.defaults import DEFAULT_CALLBACK_NAMES

        cmd += [f"--drop_callbacks=[{','.join(DEFAULT_CALLBACK_NAMES)}]", "--trainer.logger=false"]
        cmd += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
        cmd += ["--trainer.enable_model_summary=false"]
    else:
        cmd += ["--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=50"]
    cmd += ["--trainer.callbacks+=bench.cudagraphs.StepMarks"] if mark else []
    cmd += ["--data.on_device=true"] if on_device else []
    cmd += ["--trainer.callbacks+=bench.cudagraphs.StepKernels"] if kernels else []
    cmd += ["--model.optimizer.init_args.fused=true"] if fused else []
    cmd += ["--trainer.profiler=bench.host_overhead.StepActions"] if actions else []
    return cmd + (["--trainer.callbacks+=bench.cudagraphs.StepProfile"] if profile else [])


def run_variant(variant: str, args, data_dir: Path, logs: Path, repeat: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        times = Path(workdir) / "steps.json"
        stem = f"{variant}.r{repeat + 1}" if args.repeats > 1 else variant
        log = logs / f"{stem}.log"
        profile, kernels = logs / f"{stem}.profile.txt", logs / f"{stem}.kernels.json"
        actions = logs / f"{stem}.actions.json"
        env = {**os.environ, "TORCH_LOGS": TORCH_LOGS, STEP_TIMES: str(times), PROFILE: str(profile)}
        env[KERNELS], env[ACTIONS] = str(kernels), str(actions)
        env["PYTHONPATH"] = str(ROOT)
        with log.open("w") as out:
            result = subprocess.run(
                command(variant, args, data_dir),
                cwd=workdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
            )
        if result.returncode != 0:  # said, and the other variants still run: one GPU call measures them all
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            print(
                f"{variant} failed (exit {result.returncode}); the end of {log}:\n{tail}", file=sys.stderr, flush=True
            )
            return {"repeat": repeat + 1, "variant": variant, "ms per step": None, "failed": result.returncode}
        steps = json.loads(times.read_text())
    row = {"repeat": repeat + 1, **summarize(variant, steps, log.read_text())}
    if kernels.exists():
        row.update(json.loads(kernels.read_text()))
    if actions.exists():  # the largest own times, us per step
        timed = json.loads(actions.read_text())["actions"]
        row["actions per step"] = round(sum(a["calls"] for a in timed.values()), 1)
        row["action us per step"] = round(sum(a["us"] for a in timed.values()), 1)
        row["top actions (us)"] = "; ".join(f"{name} {a['us']:g}" for name, a in list(timed.items())[:12])
    return row


def spread(rows: list[dict]) -> str:
    """Each variant's mean step time over the repeats (median, min-max) and its ratio to the plain loop of the same
    repeat with the same data path (``plain+device`` for a ``+device`` variant), as a markdown table: the figures the
    issue's targets are stated in."""
    plain = {
        (row["variant"], row["repeat"]): row["ms per step"]
        for row in rows
        if row["variant"] in ("plain", "plain+device") and row["ms per step"]
    }
    lines = ["| variant | repeats | ms per step median (min-max) | plain loop / variant median (min-max) |"]
    lines.append("|---|---|---|---|")
    for variant in dict.fromkeys(row["variant"] for row in rows):
        runs = [row for row in rows if row["variant"] == variant and row["ms per step"]]
        times = [row["ms per step"] for row in runs]
        reference = "plain+device" if "+device" in variant else "plain"
        ratios = [
            plain[reference, row["repeat"]] / row["ms per step"] for row in runs if (reference, row["repeat"]) in plain
        ]
        cell = f"{median(times):.3f} ({min(times):.3f}-{max(times):.3f})" if times else ""
        ratio = f"{median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""
        lines.append(f"| {variant} | {len(runs)} | {cell} | {ratio} |")
    return "\n".join(lines)


def percentiles(values: list[float]) -> tuple[float, float, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], ordered[-1]


def summarize(variant: str, steps: dict, log: str) -> dict:
    row: dict = {"variant": variant, "steps": len(steps["host_ms"])}
    period = steps.get("period_ms") or steps["host_ms"]  # on CPU: the host's clock
    row["ms per step"] = round(sum(period) / len(period), 3) if period else None  # mean: what an epoch takes
    for kind in ("host", "device"):
        figures = percentiles(steps[f"{kind}_ms"])
        if figures:
            row[f"{kind} ms median/p90/max"] = "/".join(f"{v:.2f}" for v in figures)
    row.update({name: len(re.findall(pattern, log)) for name, pattern in MECHANISMS.items()})
    row["perf hints"] = sum("perf_hints" in line or "[__perf_hints]" in line for line in log.splitlines())
    reasons = Counter(re.findall(r"Re-recording function=\S+, mode=\S+, reason=([^\n]{0,80})", log))
    row["re-record reasons"] = "; ".join(f"{n}x {r}" for r, n in reasons.most_common(3))
    row.update({f"dynamo {k}": v for k, v in steps.get("dynamo", {}).items()})
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.cudagraphs", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch (the last epoch is timed)")
    parser.add_argument("--precision", default="bf16-mixed", choices=["32", "bf16-mixed"])
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile-mode", default="reduce-overhead")
    parser.add_argument("--variants", default="plain,cli,lightning,lightning+mark")
    parser.add_argument("--baseline", type=Path, help="another checkout, run as the variant 'baseline'")
    parser.add_argument("--data-dir", type=Path, help="Fashion-MNIST files (default: the synthetic stand-in)")
    parser.add_argument("--source", default="synthetic", choices=["synthetic", "fashion_mnist"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every variant, round robin")
    parser.add_argument("--no-record", action="store_true", help="print only (no bench/results files)")
    args = parser.parse_args(argv)

    name = f"cudagraphs-{args.arch}-b{args.batch_size}" + (f"-{args.compile_mode}" if args.compile else "-eager")
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    logs = RESULTS / f"{name}-{device}-logs" if not args.no_record else Path(tempfile.mkdtemp(prefix="cudagraphs-"))
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = args.data_dir or Path(scratch) / "data"
        rows = []
        for repeat in range(args.repeats):  # round robin: a drift of the machine's speed touches every variant
            for variant in args.variants.split(","):
                row = run_variant(variant, args, data_dir, logs, repeat)
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    print(spread(rows))
    if not args.no_record:
        notes = (
            "ms per step: the mean time from one step's start to the next's on the device clock (the host's on CPU),"
            " so what an epoch takes. Per-step times over the timed steps; log lines of"
            f" `TORCH_LOGS={TORCH_LOGS}`, kept in `{logs.name}/`.\n\n{spread(rows)}"
        )
        print(record(name, "bench.cudagraphs", rows, columns, notes=notes, device=device))
    return rows


if __name__ == "__main__":
    main()
