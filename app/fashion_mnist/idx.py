"""Read and write the IDX file format of (Fashion-)MNIST, with validation that names the file.

An IDX file is a 4-byte magic number ``0x00 0x00 <dtype> <ndim>``, then ``ndim`` big-endian uint32 sizes, then
the data in C order. Fashion-MNIST uses dtype 0x08 (unsigned byte): images are ``(N, 28, 28)`` (magic 0x803),
labels ``(N,)`` (magic 0x801). Files may be gzip-compressed (``.gz``), as they are distributed.

The content's MD5 sums are checked in :mod:`app.fashion_mnist.datafiles` (:func:`read_idx_bytes` gives the
decompressed bytes they are taken of). torchvision has no IDX writer, hence :func:`write_idx` for the synthetic
stand-in.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from pathlib import Path

import torch

from app.checkpoints.atomic import write_bytes
from app.errors import UserError

UBYTE = 0x08


class DataFileError(UserError):
    """A data file is missing, truncated, corrupt or of the wrong shape. The message names the file."""


def read_idx(path: str | os.PathLike, ndim: int | None = None) -> torch.Tensor:
    """Read a uint8 IDX file (plain or ``.gz``) into a tensor, checking magic number, sizes and length."""
    # Not torchvision's read_image_file: it reads no .gz, and a bad file is a bare assert or shape error, no file name.
    return parse_idx(read_idx_bytes(path), path, ndim)


def read_idx_bytes(path: str | os.PathLike) -> bytes:
    """The content of an IDX file: its bytes, decompressed when it is a ``.gz``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if path.suffix == ".gz" else raw
    except FileNotFoundError:
        raise DataFileError(f"{path}: file not found") from None
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise DataFileError(f"{path}: cannot decompress ({err})") from None


def parse_idx(data: bytes, path: str | os.PathLike, ndim: int | None = None) -> torch.Tensor:
    """The tensor an IDX file's content (``data``, read from ``path``) holds, checking magic number, sizes and length.

    The errors say what is wrong with the file, not how to get a good one: that depends on where it came from
    (:mod:`app.fashion_mnist.datafiles` adds it)."""
    path = Path(path)
    if len(data) < 4:
        raise DataFileError(f"{path}: truncated ({len(data)} bytes, no IDX header)")
    zero1, zero2, dtype, dims = data[:4]
    magic = int.from_bytes(data[:4], "big")
    if zero1 or zero2 or dtype != UBYTE or (ndim is not None and dims != ndim):
        want = f"0x{UBYTE << 8 | ndim:08x}" if ndim is not None else f"0x{UBYTE << 8:08x} + ndim"
        raise DataFileError(f"{path}: wrong magic number 0x{magic:08x} (expected {want}: uint8 IDX); not an IDX file")
    header = 4 + 4 * dims
    if len(data) < header:
        raise DataFileError(f"{path}: truncated header")
    shape = struct.unpack(f">{dims}I", data[4:header])
    expected = header + math.prod(shape)
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise DataFileError(f"{path}: {what}: {len(data)} bytes for shape {tuple(shape)}, expected {expected}")
    if not math.prod(shape):
        return torch.empty(shape, dtype=torch.uint8)  # valid, if useless: the caller says what it needed
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(shape)


def write_idx(path: str | os.PathLike, tensor: torch.Tensor) -> None:
    """Write a uint8 tensor as an IDX file, atomically (a reader never sees a half-written file)."""
    path = Path(path)
    if tensor.dtype != torch.uint8:
        raise TypeError(f"write_idx needs a uint8 tensor, got {tensor.dtype}")
    header = bytes([0, 0, UBYTE, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    payload = header + tensor.contiguous().numpy().tobytes()
    if path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    write_bytes(path, payload)
