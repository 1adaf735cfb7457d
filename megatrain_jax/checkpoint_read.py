"""Reading training checkpoints (``checkpoint.py`` writes them): checked array by array, replicated or sharded.

Resume restores array by array and compares each with its crc32; a sharded checkpoint (``checkpoint_shards.py``)
is put together from the shards holding the values a store needs, so a run resumes with any number of processes.
``megatrain-jax export`` reads a committed checkpoint's master weights with ``read_checkpoint_meta`` and
``group_arrays``.
"""
from __future__ import annotations

import json
import os

import numpy as np

import megatrain_jax.checkpoint_shards as shards
from megatrain_jax.checkpoint import (BLOCK_ALIGN, MANIFEST, STATE, CorruptCheckpoint, Log, crc32, leftovers,
                                      list_checkpoints, read_meta, set_aside, set_aside_incomplete, store_layouts)
from megatrain_jax.checkpoint_files import file_crc
from megatrain_jax.errors import UserError
from megatrain_jax.orbax_io import checkpointer, restore_array


def read_checkpoint_meta(path: str) -> tuple[dict, dict]:
    """``(manifest, state)`` of a complete checkpoint (``checkpoint.read_meta``); ``CorruptCheckpoint`` when not."""
    manifest, state_bytes = read_meta(path)
    try:
        state = json.loads(state_bytes)
    except ValueError as e:
        raise CorruptCheckpoint(f"{STATE} is not valid JSON ({e})") from None
    return manifest, state


def load_group_array(ckptr, path: str, name: str, key: str, info: dict) -> np.ndarray:
    """One array of a saved group, checked against the manifest (``CorruptCheckpoint`` if not as recorded).
    Public: ``hf export`` reads checkpoint groups with it."""
    where = f"group {name} array {info.get('name', key)}"
    try:
        arr = restore_array(ckptr, os.path.join(path, "groups", name), key)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds on damaged files
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CorruptCheckpoint(f"{where} cannot be read ({type(e).__name__}: {msg})") from None
    if arr.dtype.name != info["dtype"] or list(arr.shape) != info["shape"]:
        raise CorruptCheckpoint(f"{where} is {arr.dtype} {arr.shape}, the manifest says {info['dtype']} {info['shape']}")
    if crc32(arr) != info["crc32"]:
        raise CorruptCheckpoint(f"{where} fails its crc32 checksum")
    return arr


def check_compatible(state: dict, store, path: str) -> None:
    """The checkpoint's groups and leaf shapes must be the store's (else: a different model)."""
    saved = state.get("layouts", {})
    have = store_layouts(store)
    if set(saved) != set(have):
        raise UserError("model", f"checkpoint {path} holds groups {list(saved)[:4]}... but the configured model has "
                        f"{list(have)[:4]}... ({len(saved)} vs {len(have)} groups)",
                        "resume with the model config the run was started with (see config.yaml in train.out_dir)")
    for name in have:
        if [x[:2] for x in saved[name]] != [x[:2] for x in have[name]]:
            diff = next((a, b) for a, b in zip(saved[name] + [None] * 99, have[name] + [None] * 99)
                        if a is None or b is None or a[:2] != b[:2])
            raise UserError("model", f"checkpoint {path} group {name} has {diff[0] and diff[0][:2]}, the configured "
                            f"model has {diff[1] and diff[1][:2]}",
                            "resume with the model config the run was started with (see config.yaml in train.out_dir)")


def restore_into(path: str, store, host_opt) -> dict:
    """Load a checkpoint into ``store`` (master, bf16 copy, optimizer state); returns its state.json.

    Array by array, each checked against its crc32 (peak extra memory: about two arrays). Raises
    ``CorruptCheckpoint`` for damaged files (the store is then partly overwritten: restore another
    checkpoint over it) and ``UserError`` for a checkpoint of another model or optimizer.
    """
    manifest, state = read_checkpoint_meta(path)
    check_compatible(state, store, path)
    ckptr = checkpointer()

    def incompatible(detail: str) -> UserError:
        return UserError("optim", f"checkpoint {path} holds {state.get('optimizer')} state that the configured "
                         f"{getattr(host_opt, 'label', type(host_opt).__name__)} cannot take ({detail})",
                         "resume with the optim settings the run was started with (see config.yaml in train.out_dir)")

    parts = shard_parts(path, manifest)
    owned = getattr(store, "owned", None)
    for g in store:
        live = _live_state_arrays(host_opt, g)
        want = owned[g.name] if owned else None  # (a sharded store: only its own values are read and written)
        entry, arrays = group_arrays(ckptr, path, manifest, parts, g.name, want, getattr(store, "align", 1))
        saved_names = {info["name"] for key, info in entry["arrays"].items() if key != "master"}
        if live is not None and set(live) != saved_names:
            raise incompatible(f"state arrays {sorted(saved_names)}, expected {sorted(live)}")
        opt_arrays = {}
        for key, info in entry["arrays"].items():
            arr = arrays.pop(key)
            if key == "master":
                _copy_owned(g.master, arr, want, g.size, store)
            elif live is not None:  # straight into the optimizer's own buffers: no second state
                dst = live[info["name"]]
                if dst.shape != arr.shape or dst.dtype != arr.dtype:
                    raise incompatible(f"{info['name']} is {arr.dtype} {arr.shape}, expected {dst.dtype} {dst.shape}")
                _copy_owned(dst, arr, want, g.size, store)
            else:
                opt_arrays[info["name"]] = arr
            del arr
        g.sync_stream()
        if live is None:
            try:
                g.opt_state = host_opt.state_from_arrays(opt_arrays, g.master, g.layout.unflatten)
            except (ValueError, KeyError, TypeError) as e:
                raise incompatible(str(e)) from None
        del opt_arrays
    return state


def shard_parts(path: str, manifest: dict) -> list[dict] | None:
    """A sharded checkpoint's shard manifests (checked), or None for a replicated one."""
    if not manifest.get("shards"):
        return None
    try:
        return shards.shard_manifests(path, manifest, read_checkpoint_meta)
    except (OSError, ValueError, KeyError) as e:
        raise CorruptCheckpoint(f"its shards cannot be read ({type(e).__name__}: {e})") from None


def group_arrays(ckptr, path: str, manifest: dict, parts: list[dict] | None, name: str,
                 want: tuple[int, int] | None = None, align: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """A group's saved arrays, checked: ``(entry, {key: array})`` (``entry["arrays"]``: key -> info). A sharded
    checkpoint's are put together from the shards holding values ``want`` (None: every value)."""
    if parts is None:
        entry = manifest.get("groups", {}).get(name)
        if entry is None:
            raise CorruptCheckpoint(f"group {name} is missing from the manifest")
        return entry, {k: load_group_array(ckptr, path, name, k, info) for k, info in entry["arrays"].items()}
    if any(name not in sm.get("groups", {}) for sm in parts):
        raise CorruptCheckpoint(f"group {name} is missing from a shard's manifest")
    arrays = shards.read_group(name, parts, lambda sd, k, info: load_group_array(ckptr, os.path.join(path, sd), name,
                                                                                 k, info), want, align)
    return parts[0]["groups"][name], arrays


def _copy_owned(dst: np.ndarray, arr: np.ndarray, want: tuple[int, int] | None, size: int, store) -> None:
    """``dst[...] = arr``, or for a sharded store only its own values (elementwise, or their blocks)."""
    if want is None:
        dst[...] = arr
    elif dst.shape[0] == size:
        dst[want[0]:want[1]] = arr[want[0]:want[1]]
    else:
        lo, hi = want[0] // store.align, -(-want[1] // store.align)
        dst[lo:hi] = arr[lo:hi]


def _live_state_arrays(host_opt, g) -> dict[str, np.ndarray] | None:
    """The group's optimizer-state arrays when ``state_to_arrays`` hands out the state's own
    buffers (``FusedAdamW``): restoring writes into them, one array at a time. ``None`` when it
    gives copies (then ``state_from_arrays`` builds a new state)."""
    if g.opt_state is None:
        g.opt_state = host_opt.init_state(g.master, g.layout.unflatten)  # zero pages, untouched until written
    arrays = host_opt.state_to_arrays(g.opt_state)
    state = g.opt_state
    if isinstance(state, dict) and all(isinstance(a, np.ndarray) and a.flags.writeable and state.get(k) is a
                                       for k, a in arrays.items()):
        return arrays
    return None


def restore_latest(root: str, store, host_opt, log: Log = print) -> tuple[str, dict]:
    """Restore the newest checkpoint that passes its checks; corrupted ones are moved aside.

    Returns ``(path, state)``. ``UserError`` when there is none (or none usable).
    """
    for path in leftovers(root):
        log(f"checkpoint: ignoring {path} (an interrupted save; the checkpoints before it are intact)")
    incomplete = set_aside_incomplete(root)  # never resumed from, nor kept as if it were a checkpoint
    cks = list_checkpoints(root)
    if not cks:
        gone = "".join(f"; {p} is corrupted or incomplete ({why}): moved it to {aside}" for p, why, aside in incomplete)
        raise UserError("--resume", f"no complete checkpoint in {root}{gone}",
                        "train without --resume to start a new run, or set train.out_dir to the run to continue")
    bad = []
    for c in reversed(cks):
        try:
            state = restore_into(c.path, store, host_opt)
        except CorruptCheckpoint as e:
            aside = set_aside(c.path)
            bad.append(c.path)
            log(f"checkpoint: {c.path} is corrupted: {e}; moved it to {aside} and "
                f"{'falling back to the previous checkpoint' if c is not cks[0] else 'no older checkpoint is left'}")
            continue
        for p, why, aside in incomplete:
            log(f"checkpoint: {p} is corrupted or incomplete ({why}); moved it to {aside}; falling back to the "
                f"previous checkpoint: resuming from step {c.step} ({c.path})")
        if bad:
            log(f"checkpoint: resuming from {c.path} (step {c.step}) instead of the corrupted {', '.join(bad)}")
        return c.path, state
    raise UserError("--resume", f"every checkpoint in {root} is corrupted ({', '.join(bad)}; moved aside as .corrupt)",
                    "start a new run without --resume (or in another train.out_dir), or restore the checkpoint "
                    "files from a backup")


def load_checkpoint_arrays(path: str) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Every array of a checkpoint, checked: ``({group: {"master": ..., <opt name>: ...}}, state)``.
    Holds the whole model in memory: for tests and small models."""
    manifest, state = read_checkpoint_meta(path)
    ckptr, parts = checkpointer(), shard_parts(path, manifest)
    out = {}
    for name in manifest["order"] if parts else manifest["groups"]:
        entry, arrays = group_arrays(ckptr, path, manifest, parts, name, align=BLOCK_ALIGN)
        out[name] = {info.get("name", key): arrays[key] for key, info in entry["arrays"].items()}
    return out, state


def read_checked(path: str) -> dict:
    """A checkpoint of files' ``state.json``, once every file its manifest lists is there with its crc32
    (``checkpoint.CorruptCheckpoint`` otherwise)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{MANIFEST} unreadable ({e})") from None
    for rel, crc in manifest.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full) or file_crc(full) != crc:
            raise CorruptCheckpoint(f"{rel} is missing or fails its checksum")
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)
