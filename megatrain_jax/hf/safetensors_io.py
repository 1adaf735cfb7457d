"""safetensors files read and written tensor by tensor (an 8-byte header length, a JSON header, then
raw little-endian data): the importer reads one tensor at a time straight into the host store and
every writer streams one tensor at a time to disk, so no whole-shard buffer exists in between (the
``safetensors`` library's ``save_file`` builds one, twice the shard with the bytes copy)."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from megatrain_jax.errors import UserError

# safetensors dtype name -> numpy dtype; public: hf/importer.py and hf/mt.py read tensors by it
ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in a safetensors file."""

    name: str
    path: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors listed in a safetensors file (name -> ``TensorInfo``) and its metadata."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(path, f"is not a readable safetensors file ({e})",
                        "re-save the checkpoint with save_pretrained(safe_serialization=True)") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, spec in header.items():
        begin, end = spec["data_offsets"]
        if base + end > size:
            raise UserError(path, f"tensor {name!r} runs past the end of the file (truncated download?)",
                            "download the checkpoint again")
        out[name] = TensorInfo(name, path, spec["dtype"], tuple(int(d) for d in spec["shape"]), base + begin, end - begin)
    return out, meta


def read_exact(f, view: memoryview) -> None:
    """Fill ``view`` from ``f`` (a short read is a truncated file). Public: hf/mt.py reads raw tensors with it."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise UserError(f.name, "ended early while reading a tensor (truncated file?)", "download the checkpoint again")
        got += n


def read_tensor(f, info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """One tensor from an open file; read straight into ``out`` when given (same dtype, contiguous)."""
    dtype = ST_DTYPES[info.dtype]
    if out is None:
        out = np.empty(info.shape, dtype)
    f.seek(info.start)
    read_exact(f, memoryview(out.reshape(-1).view(np.uint8)))
    return out


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor: the header first (names, dtypes, shapes are
    known up front), then each tensor's bytes in the declared order. One tensor in memory at a time."""

    def __init__(self, path: str, entries: list[tuple[str, Any, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        offset = 0
        self.expected = []
        for name, dtype, shape in entries:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected.append((name, dtype, tuple(shape)))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self.path, self.nbytes, self._next = path, offset, 0
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, array: np.ndarray) -> None:
        want, dtype, shape = self.expected[self._next]
        if name != want or array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"{self.path}: expected {want} {dtype} {shape}, got {name} {array.dtype} {array.shape}")
        array = np.ascontiguousarray(array)
        self._f.write(memoryview(array.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.expected):
            raise ValueError(f"{self.path}: {len(self.expected) - self._next} tensors not written")
        self._f.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


def copy_cast(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> None:
    """``dst[...] = src`` with a dtype cast; a transposed 2-D ``src`` is copied in tiles (cache
    friendly: ~3x faster than one strided copy for 7B-sized matrices)."""
    if dst.ndim != 2 or src.flags.c_contiguous:
        np.copyto(dst, src, casting="unsafe")
        return
    rows, cols = dst.shape
    for r in range(0, rows, tile):
        for c in range(0, cols, tile):
            np.copyto(dst[r:r + tile, c:c + tile], src[r:r + tile, c:c + tile], casting="unsafe")

