"""Where a run's files live: a local folder, or any fsspec URL (``memory://``, ``sftp://host/path``, ``s3://bucket/``,
``gs://bucket/``, ...).

:func:`run_path` turns ``--trainer.default_root_dir``, a logger's folder or a checkpoint's path into a path object:
``pathlib.Path`` for a local path or a ``file://`` URL, universal_pathlib's ``UPath`` (the same API, over fsspec)
for any other URL. The run-folder, resume and checkpoint code then reads the same either way; only a write's last
step differs (:func:`move_onto`, :func:`remove_tree`). Lightning's loggers and ModelCheckpoint already take URLs.

Credentials are fsspec's: ``~/.ssh`` or an ssh-agent for ``sftp://``, the usual environment variables and files for
``s3://`` (s3fs) and ``gs://`` (gcsfs), which the user installs.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path, PurePath
from typing import Any

from app.errors import UserError


def is_url(where: Any) -> bool:
    """Whether ``where`` names a folder or file by a URL other than ``file://``."""
    text = os.fspath(where) if isinstance(where, os.PathLike) else str(where)
    return "://" in text and not text.startswith("file://")


def run_path(where: Any) -> Path:
    """``where`` as a path object: ``Path`` when it is local (a ``file://`` URL included), else a ``UPath``.

    Typed ``Path`` for the code that uses it: a ``UPath`` has the methods that code calls (``/``, ``glob``,
    ``exists``, ``is_file``, ``mkdir``, ``open``, ``read_text``, ``stat``, ``name``, ``parent``)."""
    if isinstance(where, Path) or _is_upath(where):
        return where
    text = os.fspath(where)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if "://" not in text:
        return Path(text)
    from upath import UPath

    _keep_sftp_hosts()
    from fsspec.registry import get_filesystem_class

    try:
        get_filesystem_class(text.split("://", 1)[0])  # imported now: a missing package is one line here
        return UPath(text)
    except ImportError as err:  # fsspec's own message names the package: "Install s3fs to access S3"
        raise UserError(f"{text}: {err} (pip install it into this environment)") from None
    except ValueError as err:  # a protocol fsspec does not know
        raise UserError(f"{text}: {err}") from None


@functools.cache
def _keep_sftp_hosts() -> None:
    """universal_pathlib writes an ``sftp://user@host:port/path`` as ``sftp:///path`` (the host goes into its storage
    options): the run's lines, config.yaml and ``--ckpt_path`` would name a path that no other process can find.
    Its sftp paths here say where they are."""
    from upath.implementations.sftp import SFTPPath
    from upath.registry import register_implementation

    class HostedSFTPPath(SFTPPath):
        __slots__ = ()

        def __str__(self) -> str:
            options = self.storage_options
            user = f"{options['username']}@" if options.get("username") else ""
            port = f":{options['port']}" if options.get("port") else ""
            return f"{self.protocol}://{user}{options.get('host', '')}{port}{self.path}"

    for protocol in ("sftp", "ssh"):
        register_implementation(protocol, HostedSFTPPath, clobber=True)


def _is_upath(path: Any) -> bool:
    return not isinstance(path, PurePath) and hasattr(path, "storage_options")


def is_local(path: Path) -> bool:
    """Whether a path from :func:`run_path` is on this machine's filesystem (os calls work on it)."""
    return not _is_upath(path)


def move_onto(source: Path, target: Path) -> None:
    """Rename ``source`` onto ``target`` (the same filesystem), replacing it: ``os.replace`` locally; fsspec's ``mv``
    on a URL, which is a server-side rename on sftp (OpenSSH's posix-rename: atomic) and a copy then a delete on
    object stores (each object written whole: a reader sees the old one or the new one)."""
    if is_local(source):
        os.replace(source, target)
    else:
        source.fs.mv(source.path, target.path)


def remove_tree(folder: Path) -> None:
    """Remove ``folder`` and everything in it; nothing when it is gone already."""
    if is_local(folder):
        shutil.rmtree(folder, ignore_errors=True)
    elif folder.exists():
        folder.fs.rm(folder.path, recursive=True)
