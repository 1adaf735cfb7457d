"""Which devices a run uses, and the multi-process (multi-host) runtime: JAX's own.

One process per host drives that host's GPUs; the processes join through
``jax.distributed.initialize`` (its coordination service; NCCL collectives on GPUs, gloo on CPUs).
Every process keeps a full replica of the host store and applies the same update to it: the
gradient every process receives is the result of one all-reduce (the same bits on every member),
and the host update is a deterministic element-wise kernel of (weights, gradient, state, step), so
the replicas stay bit-identical without ever being compared or broadcast. Process 0 writes the
checkpoints, metrics and logs.

Launch (each process gets the same command and config; only the id differs):

    MEGATRAIN_COORDINATOR=host0:12355 MEGATRAIN_NUM_PROCESSES=2 MEGATRAIN_PROCESS_ID=0 megatrain-jax train CFG
    MEGATRAIN_COORDINATOR=host0:12355 MEGATRAIN_NUM_PROCESSES=2 MEGATRAIN_PROCESS_ID=1 megatrain-jax train CFG

``MEGATRAIN_HEARTBEAT_S`` (optional): seconds without a process's heartbeat before the others end (JAX's 100).
``MEGATRAIN_SHARD_WAIT_S`` (optional): seconds process 0 waits for the other shards of a checkpoint (600).
With ``train.host_state=sharded`` each process keeps only its GPUs' shares instead of a replica (hoststore.own).
"""
from __future__ import annotations

import os

import jax

from megatrain_jax.errors import UserError

ENV = ("MEGATRAIN_COORDINATOR", "MEGATRAIN_NUM_PROCESSES", "MEGATRAIN_PROCESS_ID")
SHARD_WAIT_S = 600  # process 0 waits this long for the other shards of a save before it fails (the tests: 2 s)


def initialize_from_env() -> bool:
    """Join the run described by the MEGATRAIN_* variables (before any JAX backend starts); False
    when none is set (one process). A half-set or malformed description is refused in one line."""
    given = {k: os.environ.get(k) for k in ENV}
    if not any(given.values()):
        return False
    missing = [k for k, v in given.items() if not v]
    if missing:
        raise UserError(missing[0], "is not set, but the other multi-process variables are",
                        "set all of " + ", ".join(ENV) + " (or none, for one process)")
    coord = given["MEGATRAIN_COORDINATOR"]
    if ":" not in coord:
        raise UserError("MEGATRAIN_COORDINATOR", f"must be host:port, got {coord!r}", "e.g. MEGATRAIN_COORDINATOR=node0:12355")
    try:
        n, i = int(given["MEGATRAIN_NUM_PROCESSES"]), int(given["MEGATRAIN_PROCESS_ID"])
    except ValueError:
        raise UserError("MEGATRAIN_NUM_PROCESSES", "and MEGATRAIN_PROCESS_ID must be integers",
                        "e.g. MEGATRAIN_NUM_PROCESSES=2 MEGATRAIN_PROCESS_ID=0") from None
    if n < 1 or not 0 <= i < n:
        raise UserError("MEGATRAIN_PROCESS_ID", f"must be in 0..{n - 1} for {n} processes, got {i}",
                        "number the processes 0..N-1")
    # how long the others wait for a process that stopped answering before the run ends (JAX's default: 100 s)
    heartbeat = positive_seconds("MEGATRAIN_HEARTBEAT_S", 100, "e.g. MEGATRAIN_HEARTBEAT_S=30, or unset for JAX's 100 s")
    shard_wait_s()  # refused here, before anything joins, not at the first save
    if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coord, num_processes=n, process_id=i,
                               heartbeat_timeout_seconds=heartbeat)
    return True


def positive_seconds(name: str, default: int, fix: str) -> int:
    """A whole number of seconds from the environment variable ``name`` (``default`` when unset); anything else is
    refused in one line naming it."""
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(name, f"must be a positive number of seconds, got {raw!r}", fix)
    return value


def shard_wait_s() -> int:
    """How long process 0 waits for the other processes' shards of a save before it fails that save
    (``MEGATRAIN_SHARD_WAIT_S``, default 600 s)."""
    return positive_seconds("MEGATRAIN_SHARD_WAIT_S", SHARD_WAIT_S,
                            f"e.g. MEGATRAIN_SHARD_WAIT_S={SHARD_WAIT_S}, or unset for {SHARD_WAIT_S} s")


def run_devices(spec: int | str = "all") -> list[jax.Device]:
    """The devices of the run: ``all`` of each process's local devices, or the first N of each
    (``train.devices``), in process order: the mesh the engine builds over them."""
    per_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        per_process.setdefault(d.process_index, []).append(d)
    out = []
    for p in sorted(per_process):
        local = sorted(per_process[p], key=lambda d: d.id)
        if spec != "all":
            if int(spec) > len(local):
                raise UserError("train.devices", f"asks for {spec} devices, process {p} has {len(local)}",
                                f"set train.devices={len(local)} or all")
            local = local[:int(spec)]
        out.extend(local)
    return out


def is_main() -> bool:
    """Process 0 writes checkpoints, metrics and logs. Read from the launch variables, not from
    ``jax.process_index()``: asking JAX would start its backend before the memory plan has given
    XLA its budgets (a backend started early takes XLA's default 75% of the GPU)."""
    return os.environ.get("MEGATRAIN_PROCESS_ID", "0").strip() in ("", "0")


def check_shared_dir(out_dir: str) -> None:
    """``train.host_state=sharded`` over several processes: each writes its checkpoint shard under ``out_dir`` and
    process 0 commits the step once it sees them all, so every process must see the one directory (several hosts: a
    filesystem they all mount, at the same path). Checked before the trainer is built, through JAX's coordination
    service (no backend starts): process 0 makes a probe file in the nearest existing folder of ``out_dir``, the
    others look for it at the same place relative to their own ``out_dir``; where any does not see it every process
    refuses in one line. The probe is removed at once: nothing stays."""
    import tempfile

    from orbax.checkpoint import multihost

    n, p = int(os.environ.get("MEGATRAIN_NUM_PROCESSES") or 1), int(os.environ.get("MEGATRAIN_PROCESS_ID") or 0)
    if n < 2 or not multihost.is_jax_distributed_client_initialized():
        return
    client, key, wait_ms = multihost.get_jax_distributed_client(), "megatrain/shared_dir/", shard_wait_s() * 1000
    here = os.path.abspath(out_dir)
    if p == 0:
        folder = here
        while not os.path.isdir(folder):
            folder = os.path.dirname(folder)
        fd, probe = tempfile.mkstemp(prefix=".megatrain-shared-check-", dir=folder)
        os.close(fd)
        try:
            client.key_value_set(key + "probe", os.path.relpath(probe, here))
            unseen = [q for q in range(1, n) if client.blocking_key_value_get(f"{key}seen/{q}", wait_ms) != "1"]
            client.key_value_set(key + "unseen", ",".join(map(str, unseen)))
        finally:
            os.unlink(probe)
    else:
        rel = client.blocking_key_value_get(key + "probe", wait_ms)
        seen = os.path.exists(os.path.normpath(os.path.join(here, rel)))  # (normalised: out_dir may not exist yet)
        client.key_value_set(f"{key}seen/{p}", "1" if seen else "0")
        unseen = [int(q) for q in client.blocking_key_value_get(key + "unseen", wait_ms).split(",") if q]
    if unseen:
        who = f"process {unseen[0]} of {n} does" if len(unseen) == 1 else \
            f"processes {', '.join(map(str, unseen))} of {n} do"
        raise UserError("train.out_dir", f"{who} not see process 0's files under {out_dir}, where a sharded host "
                        "state commits every process's checkpoint shards",
                        "put train.out_dir on a filesystem every host mounts (e.g. NFS), at the same path on each")
