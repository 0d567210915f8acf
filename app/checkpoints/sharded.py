"""fsdp's sharded checkpoints (``--trainer.strategy.checkpoint=sharded``): a folder that every rank writes its own
pieces into with ``torch.distributed.checkpoint`` (DCP), so that no rank ever holds the whole model, and that loads
at any number of ranks (DCP reshards on load).

A checkpoint ``last.ckpt`` is then a folder::

    last.ckpt/.metadata          DCP's index: every tensor's name, shape, dtype and where its pieces are
    last.ckpt/__0_0.distcp ...   each rank's pieces of the weights and of the optimizer's state
    last.ckpt/meta.pt            the rest of a Lightning checkpoint (loops, callbacks, schedulers, hyperparameters),
                                 written by rank 0 with torch.save

A save writes a hidden folder beside the target and, once every rank's pieces and ``meta.pt`` are in it, rank 0
moves it onto the target: a reader finds the old checkpoint or the new one. (Two renames, since a folder cannot
replace a folder in one: a kill between them leaves the new checkpoint, complete, under ``.NAME.partial`` and the
old under ``.NAME.old``, and no ``NAME``; the next save first renames that complete checkpoint into place.)

With ``--trainer.strategy.async_save=true`` a save only copies the rank's pieces (to CPU memory, on the training
thread) and writes them in the background (:class:`BackgroundSaves`); the folder is moved into place once every
rank's pieces are written, at a later training batch, the next save or the end of the run.

``python cli.py consolidate CKPT`` makes one ordinary checkpoint file of it, for ``test``, ``predict`` and
``export`` under any strategy (:func:`main`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.checkpoints.io import CHECKPOINT_FORMAT, FORMAT_KEY, atomic_torch_save, safe_torch_load
from app.checkpoints.storage import is_url, run_path
from app.errors import UserError

META = "meta.pt"
SHARDED_KEYS = ("state_dict", "optimizer_states")  # what DCP holds; meta.pt holds the rest


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder."""
    path = Path(path) if not isinstance(path, Path) else path
    return "://" not in str(path) and path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def not_loaded_here(path: Any) -> UserError:
    """The one line for a sharded checkpoint given where it cannot load (another strategy, or fsdp's full mode)."""
    if is_url(path):
        return UserError(f"{path}: a sharded checkpoint on a URL; sharded checkpoints load from a local or shared "
                         "filesystem (NFS): copy the folder there")  # fmt: skip
    return UserError(
        f"{path}: an fsdp sharded checkpoint (a folder); load it with --trainer.strategy=fsdp "
        f"--trainer.strategy.checkpoint=sharded, or make one file of it: cli.py consolidate {path}"
    )


def save_sharded(
    strategy, checkpoint: dict[str, Any], filepath: Any, background: BackgroundSaves | None = None
) -> None:
    """Every rank: write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` sharded, as
    :meth:`~app.strategies.fsdp.FSDPStrategy.lightning_module_state_dict` gives them) as a folder at ``filepath``;
    with ``background``, its pieces are copied here and written by :class:`BackgroundSaves`."""
    import torch.distributed.checkpoint as dcp

    if is_url(filepath):
        raise UserError(
            f"{filepath}: sharded checkpoints are folders renamed into place, on a local or shared filesystem (NFS); "
            "point the checkpoints there, or use --trainer.strategy.checkpoint=full"
        )
    target = Path(filepath)
    partial, old = target.parent / f".{target.name}.partial", target.parent / f".{target.name}.old"
    if background is not None:
        background.settle(wait=background.writing(target))  # one save of a folder at a time
    if strategy.is_global_zero:
        if not target.exists() and is_sharded_checkpoint(partial):  # a save killed between its renames: complete
            partial.rename(target)
        _remove(partial)  # what a save cut short left
        partial.mkdir(parents=True)
    strategy.barrier("sharded checkpoint: its folder")
    pieces = {"state_dict": checkpoint["state_dict"]}
    pieces["optimizer_states"] = {str(i): state for i, state in enumerate(checkpoint.get("optimizer_states", []))}
    if background is None:
        dcp.save(pieces, checkpoint_id=partial)
    if strategy.is_global_zero:
        meta = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}
        meta[FORMAT_KEY] = CHECKPOINT_FORMAT
        meta["optimizer_count"] = len(pieces["optimizer_states"])
        atomic_torch_save(meta, partial / META)
    commit = (lambda: _into_place(partial, target, old)) if strategy.is_global_zero else (lambda: None)
    if background is not None:
        return background.submit(pieces, partial, target, commit)
    strategy.barrier("sharded checkpoint: written")
    commit()


def _into_place(partial: Path, target: Path, old: Path) -> None:
    """Rank 0: the written folder moved onto the target (two renames; see the module's docstring)."""
    _remove(old)
    if target.exists():
        target.rename(old)
    partial.rename(target)
    _remove(old)


class BackgroundSaves:
    """Sharded saves written in the background (``--trainer.strategy.async_save=true``), for one strategy.

    :meth:`start` (every rank, at the strategy's set-up) makes a gloo process group for the saves' collectives: the
    training thread's go on meanwhile on the default group. :meth:`submit` copies the rank's pieces to new CPU
    tensors (DCP's ``DefaultStager``), on the training thread, so that the next steps' updates do not reach the
    save; one worker thread then writes the saves in the order they came (``dcp.save``), so no two saves mix their
    collectives (``dcp.async_save`` would start a thread per save). Rank 0's DCP writes the folder's ``.metadata``
    once every rank has written its pieces; :meth:`settle`, on the training thread, then moves the folder into place.
    A failed save is raised only where every rank waits for its own saves (the next save of the same folder, the
    run's end), so that every rank stops at the same point."""

    def __init__(self, timeout=None) -> None:
        self.timeout = timeout  # the saves' collectives' (a lost peer fails a save in flight after it)
        self._writer: ThreadPoolExecutor | None = None
        self._group = None
        self._pending: deque = deque()  # (future, target, commit), oldest first
        self._failures: list[str] = []

    def start(self) -> None:
        """Every rank, together (``new_group`` is a collective): the saves' process group and worker."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharded-save")

    def submit(self, pieces: dict, partial: Path, target: Path, commit: Callable[[], None]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._writer is None:  # (a save before the strategy's set-up: one process)
            self.start()
        stager = DefaultStager(StagingOptions(False, False, False, False))  # plain CPU copies, here, now
        staged = stager.stage(pieces)
        stager.close()
        future = self._writer.submit(dcp.save, staged, checkpoint_id=partial, process_group=self._group)
        self._pending.append((future, target, commit))

    def writing(self, target: Path) -> bool:
        """Whether a save of ``target`` is still in the background."""
        return any(pending == target for _, pending, _ in self._pending)

    def settle(self, wait: bool = False) -> None:
        """Move the written saves into place, oldest first; with ``wait``, wait for every save, then raise the first
        that failed (one line: its checkpoint and its cause)."""
        while self._pending and (wait or self._pending[0][0].done()):
            future, target, commit = self._pending.popleft()
            error = future.exception()
            if error is None:
                commit()
            else:
                self._failures.append(f"{target}: its background save failed ({_cause(error)})")
        if wait and self._failures:
            failures, self._failures = self._failures, []
            raise UserError(f"{failures[0]}; the checkpoint before it stays")

    def close(self, raise_failure: bool = True) -> str | None:
        """The end of the run: every save written and in place, the worker gone. Returns a failed save's line
        instead of raising it when ``raise_failure`` is false (a run already ending on another error)."""
        try:
            self.settle(wait=True)
        except UserError as error:
            if raise_failure:
                raise
            return str(error)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=False, cancel_futures=True)
                self._writer = None
        return None

    def __getstate__(self) -> dict:  # a pickled strategy (a spawned rank) starts with no save in flight
        return {"timeout": self.timeout, "_writer": None, "_group": None, "_pending": deque(), "_failures": []}


def _cause(error: BaseException) -> str:
    """A save's error in one line: the first rank's own exception, where DCP wrapped every rank's with its trace."""
    import traceback

    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if failures:
        error = next(iter(failures.values()))[0]
    return traceback.format_exception_only(type(error), error)[-1].strip()


def _remove(path: Path) -> None:
    """A folder with what is in it, or a file (a full checkpoint that a sharded one replaces)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def load_sharded(path: Any, model: nn.Module, optimizers: list) -> dict[str, Any]:
    """Every rank: load the sharded checkpoint at ``path`` into the sharded ``model`` and, when given (fit), its
    ``optimizers`` (torch's, not Lightning's wrappers), each rank reading the pieces its own shards need; returns
    ``meta.pt``'s contents, with ``state_dict`` and ``optimizer_states`` set to what was loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = safe_torch_load(Path(path) / META)
    pieces: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    raw = list(optimizers)
    if raw:
        if meta.get("optimizer_count", 0) != len(raw):
            raise UserError(
                f"{path} holds the state of {meta.get('optimizer_count', 0)} optimizer(s), this run has {len(raw)}: "
                "resume with the optimizers that wrote it"
            )
        pieces["optimizer_states"] = {str(i): get_optimizer_state_dict(model, opt) for i, opt in enumerate(raw)}
    dcp.load(pieces, checkpoint_id=Path(path))
    set_model_state_dict(model, pieces["state_dict"])
    for i, optimizer in enumerate(raw):
        set_optimizer_state_dict(model, optimizer, pieces["optimizer_states"][str(i)])
    states = list(pieces.get("optimizer_states", {}).values())
    return {**meta, "state_dict": pieces["state_dict"], "optimizer_states": states}


def read_sharded(path: Any) -> dict[str, Any]:
    """A sharded checkpoint as the run's checks read one, without loading a tensor: ``meta.pt``'s contents, and its
    ``state_dict`` as tensors on the meta device with each weight's shape and dtype (DCP's index)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = safe_torch_load(Path(path) / META)
    index = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    meta["state_dict"] = {
        key.removeprefix("state_dict."): torch.empty(item.size, dtype=item.properties.dtype, device="meta")
        for key, item in index.items()
        if key.startswith("state_dict.") and isinstance(item, TensorStorageMetadata)
    }
    meta["optimizer_states"] = [{"state": {}, "param_groups": []}] * meta.get("optimizer_count", 0)  # in the shards
    return meta


def consolidate(path: Any) -> dict[str, Any]:
    """One full Lightning checkpoint from a sharded one, in this process (no process group): the weights whole and
    the optimizer's state numbered as ``optimizer.state_dict()`` numbers it, as a ``full`` fsdp checkpoint holds."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = safe_torch_load(Path(path) / META)
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(path), f"{scratch}/full.pt")
        full = torch.load(f"{scratch}/full.pt", map_location="cpu", weights_only=True)
    checkpoint = {k: v for k, v in meta.items() if k != "optimizer_count"}
    checkpoint["state_dict"] = full["state_dict"]
    states = full.get("optimizer_states", {})
    checkpoint["optimizer_states"] = [by_index(states[str(i)]) for i in range(meta.get("optimizer_count", 0))]
    return checkpoint


def main(argv: list[str], model: Any = None) -> None:
    """``cli.py consolidate`` (``model``: cli.py's default task, which a checkpoint names itself)."""
    parser = argparse.ArgumentParser(
        prog="cli.py consolidate", description="Make one checkpoint file of an fsdp sharded checkpoint (a folder)."
    )
    parser.add_argument("ckpt_path", help="the sharded checkpoint, e.g. lightning_logs/version_0/checkpoints/last.ckpt")
    parser.add_argument("--out", help="the file to write (default: CKPT_PATH with .full.ckpt for .ckpt)")
    args = parser.parse_args(argv)
    if is_url(args.ckpt_path):
        raise UserError(f"{args.ckpt_path}: consolidate reads a local or shared folder: copy the checkpoint there")
    source = Path(args.ckpt_path)
    if not is_sharded_checkpoint(source):
        raise UserError(
            f"{source}: not a sharded checkpoint (a folder with .metadata and {META}, written under "
            "--trainer.strategy.checkpoint=sharded); a checkpoint file is whole already"
        )
    out = run_path(args.out) if args.out else source.with_name(source.name.removesuffix(".ckpt") + ".full.ckpt")
    if out.exists():
        raise UserError(f"{out} already exists; pass --out with another path (nothing is written over)")
    atomic_torch_save(consolidate(source), out)
    print(f"consolidated {source} -> {out}", file=sys.stderr)


def by_index(state: dict) -> dict:
    """torch.distributed.checkpoint names parameters by path; ``optimizer.state_dict()`` numbers them in the order
    of its param groups. The numbered form is what every other strategy saves and loads."""
    index: dict[str, int] = {}
    for group in state["param_groups"]:
        for name in group["params"]:
            index.setdefault(name, len(index))
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def by_name(state: dict, order: list[str]) -> dict:
    """The numbered form back into paths, by this optimizer's own order of parameters."""
    if sum(len(g["params"]) for g in state["param_groups"]) != len(order):
        raise UserError(
            f"the checkpoint's optimizer state holds {sum(len(g['params']) for g in state['param_groups'])} "
            f"parameters, this model's optimizer {len(order)}: resume with the optimizer that wrote it"
        )
    return {
        "state": {order[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }
