"""The files of a checkpoint of a few small files (a run of adapters: ``checkpoint.CheckpointSaver(files=)``) and
their crc32, which its manifest lists and a reader checks (``checkpoint_read.read_checked``) before trusting it.

A leaf module (nothing of the package), so that the saver and its readers share it without a cycle.
"""
from __future__ import annotations

import os
import zlib


def file_crc(path: str) -> int:
    """The crc32 of a file."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest_files(root: str, manifest: str) -> list[str]:
    """The files of a checkpoint directory that its manifest covers (all but ``manifest``), relative, sorted."""
    out = []
    for base, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(base, n), root) for n in names if n != manifest]
    return sorted(out)
