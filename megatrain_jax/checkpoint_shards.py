"""Checkpoints of a sharded host store (``train.host_state=sharded``): every process writes its own shares.

Layout of one committed checkpoint of N processes::

    step_00000010/
        shard_0/ .. shard_<N-1>/    each: groups/<group>/ (that process's values of every array) and manifest.json
                                    (crc32 of each array, and its values' range in the group: ``range``, ``size``)
        state.json                  written by process 0, as in a replicated checkpoint
        manifest.json               written last by process 0, once every shard's manifest is there: ``shards`` (N)
                                    and the crc32 of each shard's manifest

Every process writes under ``step_N.tmp/shard_<p>`` (its own directory only: no process removes another's), and
process 0 commits the whole by the one rename of ``checkpoint.py``: a checkpoint is complete only when every shard
is. A process that dies mid-save leaves no shard manifest, so process 0 never commits that step, and ``--resume``
takes the previous one. Reading gathers: each group's arrays are put together from the shards that hold the values
asked for (``read_group``), so a run resumes with any number of processes, and ``export`` reads the whole.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any, Callable

import numpy as np

from megatrain_jax.distributed import shard_wait_s
from megatrain_jax.plan.machine import process_count


def shard_of_process() -> tuple[int, int]:
    """(this process's index, processes) from the launch variables (``distributed.py``), without starting JAX."""
    return int(os.environ.get("MEGATRAIN_PROCESS_ID", "0") or 0), process_count()


def shard_dir(step_dir: str, p: int) -> str:
    return os.path.join(step_dir, f"shard_{p}")


def owned_slices(g: Any, arrays: dict[str, np.ndarray], owned: tuple[int, int], align: int) -> dict[str, np.ndarray]:
    """Views of ``arrays`` (a group's master and state) holding this process's values ``owned`` (elementwise arrays:
    those values; per-block ones: their blocks)."""
    lo, hi = owned
    out = {}
    for k, a in arrays.items():
        if a.shape[0] == g.size:
            out[k] = a[lo:hi]
        elif a.shape[0] == -(-g.size // align):
            out[k] = a[lo // align:-(-hi // align)]
        else:
            raise ValueError(f"group {g.name} array {k} of {a.shape[0]} values is neither elementwise nor per block")
    return out


def wait_for_shards(step_tmp: str, n: int, abandoned: Callable[[], bool], manifest_name: str) -> dict[str, int]:
    """Process 0, before it commits: every shard's manifest is there; returns their crc32 by shard."""
    t0, limit = time.monotonic(), shard_wait_s()
    while True:
        paths = {f"shard_{p}": os.path.join(shard_dir(step_tmp, p), manifest_name) for p in range(n)}
        missing = [s for s, path in paths.items() if not os.path.isfile(path)]
        if not missing:
            out = {}
            for s, path in paths.items():
                with open(path, "rb") as f:
                    out[s] = zlib.crc32(f.read())
            return out
        if abandoned():
            raise RuntimeError("abandoned")
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"{', '.join(missing)} of {step_tmp} not written after {limit:.0f} s (another "
                               "process stopped saving)")
        time.sleep(0.05)


def shard_manifests(path: str, manifest: dict, read_json: Callable[[str], dict]) -> list[dict]:
    """The shard manifests of a sharded checkpoint, each checked against the crc32 the top manifest recorded."""
    out = []
    for p in range(int(manifest["shards"])):
        mpath = os.path.join(shard_dir(path, p), "manifest.json")
        with open(mpath, "rb") as f:
            raw = f.read()
        if zlib.crc32(raw) != manifest["shard_crc32"][f"shard_{p}"]:
            raise ValueError(f"shard_{p}/manifest.json fails its checksum")
        out.append(json.loads(raw))
    return out


def read_group(name: str, shards: list[dict], load: Callable[[str, str, dict], np.ndarray],
               want: tuple[int, int] | None = None, align: int = 1) -> dict[str, np.ndarray]:
    """A group's arrays (key -> array, keys as in the shard manifests), put together from the shards that hold
    values ``want`` (None: all of them); values outside ``want`` are zeros. ``load(shard_dir_name, key, info)``
    reads one shard's array, checked."""
    first = shards[0]["groups"][name]
    size = int(first["size"])
    lo_w, hi_w = want if want is not None else (0, size)
    out: dict[str, np.ndarray] = {}
    for p, sm in enumerate(shards):
        entry = sm["groups"][name]
        lo, hi = entry["range"]
        if hi <= lo or hi <= lo_w or lo >= hi_w:
            continue
        for key, info in entry["arrays"].items():
            arr = load(f"shard_{p}", key, info)
            per_block = bool(info.get("per_block"))
            full_len = -(-size // align) if per_block else size
            a0 = lo // align if per_block else lo
            dst = out.get(key)
            if dst is None:
                dst = out[key] = np.zeros(full_len, arr.dtype)
            dst[a0:a0 + arr.shape[0]] = arr
    if not out:  # (this process's values are all padding: a group smaller than its share)
        for key, info in first["arrays"].items():
            out[key] = np.zeros(0, np.dtype(info["dtype"]))
    return out
