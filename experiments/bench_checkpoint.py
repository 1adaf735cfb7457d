"""Checkpoint cost: how long a background save blocks training, its total time, restore time, and
the peak extra host memory of both, for a model config.

    python experiments/bench_checkpoint.py --config configs/7b.yaml                       # GPU: real steps
    python experiments/bench_checkpoint.py --config configs/1b.yaml --mode host \\
        --set train.compute_dtype=float32 --compute-s 1.0                                 # CPU box

Modes:

- ``engine``: the real ``StreamedTrainer`` on synthetic batches (``train.batch_size`` x ``data.seq_len``
  of random tokens). Needs the model to run on this machine.
- ``host``: the host side of a training loop without the model: each step takes ``--compute-s``
  of accelerator time (a third forward, spread over the groups, each waiting for its previous
  update as the engine's fetch does; two thirds backward), then queues the real optimizer update
  of every group, in place, on the host-optimizer thread (deferred updates, ``before_update``
  called first: the engine's protocol).
  That is all a checkpoint competes with, so it measures the same blocking; use it where the model
  cannot run (a 1B model on a CPU-only box).

Protocol: warm-up steps, ``--base-steps`` steps for the baseline step time, then a background save
between two steps while training goes on until the save has committed (plus one step). Reported:

- ``save_call_s``: how long ``save()`` blocked the loop (it only waits for a previous save);
- ``held_s``: how long updates waited for the writer (the one way a save stalls training);
- ``loop_extra_s``: the overlapping steps' wall time minus as many baseline steps (what training
  actually lost, including CPU/memory-bandwidth contention with the writer);
- ``save_total_s``: start to commit of the background save; ``save_sync_s``: a save with the loop
  paused (the end-of-run / signal case); ``first_save_paused_s``: the very first save, done before
  both and kept out of the comparison (on a fresh VM disk first writes can be 3x slower);
- ``restore_s``: ``restore_into`` of the checkpoint with its files evicted from the page cache
  (``posix_fadvise(DONTNEED)``), checksums included;
- ``save_peak_extra_gb``: peak RSS during the background save (and the steps it overlaps) minus the
  peak RSS over the baseline steps; ``save_sync_peak_extra_gb`` / ``restore_peak_extra_gb``: peak
  RSS during the paused save / the restore minus the RSS just before it (sampled every 5 ms; page
  cache is not RSS).

The JSON goes to ``experiments/results/bench_checkpoint_<name>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax import checkpoint as ck  # noqa: E402

from megatrain_jax import checkpoint_read as ckr  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


class RssMonitor:
    def __init__(self, period: float = 0.005):
        self.period, self.peak, self._stop = period, rss_gb(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_gb())
            time.sleep(self.period)

    def reset(self) -> None:
        self.peak = rss_gb()

    def close(self) -> None:
        self._stop.set()
        self._t.join()


class HostLoop:
    """The host side of the engine's step (see the module docstring, ``--mode host``)."""

    def __init__(self, cfg, compute_s: float):
        from megatrain_jax.models.llama import init_host_store
        from megatrain_jax.optim import build_host_optimizer

        _, self.store = init_host_store(cfg.model, cfg.train.seed, bf16_stream=cfg.train.compute_dtype == "bfloat16")
        self.opt = build_host_optimizer(cfg.optim, 10_000)
        for g in self.store:
            g.opt_state = self.opt.init_state(g.master, g.layout.unflatten)
        rng = np.random.default_rng(0)
        self.grads = {}  # one gradient buffer per distinct group size
        for g in self.store:
            if g.size not in self.grads:
                self.grads[g.size] = (rng.standard_normal(g.size, dtype=np.float32) * 1e-3)
        self.compute_s, self.count = compute_s, 0
        self._pending, self.before_update = {}, None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optim")

    def _forward_order(self):
        names = [g.name for g in self.store]
        return ["embed", "head"] + [n for n in names if n.startswith("block_")]

    def step(self, batch=None):
        order = self._forward_order()
        for name in order:  # forward (a third of the compute): each group waits for its update
            fut = self._pending.pop(name, None)
            if fut is not None:
                fut.result()
            time.sleep(self.compute_s / 3 / len(order))
        time.sleep(self.compute_s * 2 / 3)  # backward: updates wait for the step's norm (deferred)
        self.count += 1
        for name in self._forward_order():
            self._pending[name] = self._pool.submit(self._update, name, self.count)

    def _update(self, name, count):
        g = self.store[name]
        if self.before_update is not None:
            self.before_update(name, count)
        self.opt.update(g.master, self.grads[g.size], g.opt_state, count, 1.0, g.stream_bits, g.layout.unflatten)

    def finish(self):
        for name in list(self._pending):
            self._pending.pop(name).result()

    def close(self):
        self.finish()
        self._pool.shutdown()


def engine_loop(cfg):
    from megatrain_jax.engine import Batch
    from megatrain_jax.train import build_trainer

    trainer = build_trainer(cfg)
    b, s, v = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    rng = np.random.default_rng(0)
    toks = rng.integers(0, v, (b, s + 1), dtype=np.int64).astype(np.int32)
    batch = Batch(toks[:, :-1], toks[:, 1:], np.ones((b, s), np.float32))
    return trainer, batch


def evict(path: str) -> None:
    """Drop a directory's files from the page cache (so a restore reads the disk)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--mode", choices=["engine", "host"], default="engine")
    p.add_argument("--compute-s", type=float, default=1.0, help="host mode: seconds of accelerator work per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--base-steps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: runs/bench_checkpoint)")
    p.add_argument("--name", default=None, help="result name (default: config name, mode, dtype)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--quick", action="store_true",
                   help="only the background save and the restore (no first / paused save): for big models")
    args = p.parse_args(argv)

    cfg = load_config(args.config, args.set)
    cname = os.path.splitext(os.path.basename(args.config))[0]
    name = args.name or f"{cname}_{args.mode}_{cfg.train.compute_dtype}"
    root = os.path.abspath(args.dir or os.path.join("runs", "bench_checkpoint", name))
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    rss0 = rss_gb()
    if args.mode == "engine":
        import jax

        trainer, batch = engine_loop(cfg)
        device = str(jax.devices()[0].device_kind)
    else:
        trainer, batch = HostLoop(cfg, args.compute_s), None
        device = "none (host loop)"
    build_s = time.perf_counter() - t0
    store_gb = trainer.store.nbytes() / 1e9
    print(f"{name}: {trainer.store.num_params() / 1e9:.3f}B params, host store {store_gb:.2f} GB "
          f"(RSS {rss_gb():.2f} GB), built in {build_s:.1f}s", flush=True)

    mon = RssMonitor()
    saver = ck.CheckpointSaver(trainer, root, keep_last=0, log=lambda s: print(s, flush=True))
    saver._ckptr_ready.join()

    def timed_step():
        t = time.perf_counter()
        trainer.step(batch)
        return time.perf_counter() - t

    for _ in range(args.warmup):
        print(f"warm-up step {timed_step():.2f}s", flush=True)
    mon.reset()
    base = [timed_step() for _ in range(args.base_steps)]
    base_peak = mon.peak
    step_s = float(np.median(base))
    print(f"baseline step {step_s:.3f}s (median of {base}), peak RSS {base_peak:.2f} GB", flush=True)

    # a first save, loop paused: on a fresh disk/VM the first writes are often much slower; it is
    # reported, but kept out of the comparison below
    first_s = None
    if not args.quick:
        mon.reset()
        t = time.perf_counter()
        saver.save(trainer.count, {"config": cfg.to_dict(), "bench": "first"}, wait=True)
        first_s = time.perf_counter() - t
        print(f"first save (paused): {first_s:.1f}s", flush=True)
        shutil.rmtree(saver.last_path)  # disk: at most two checkpoints at a time
        trainer.step(batch)
    trainer.finish()

    # background save while training continues
    mon.reset()
    step_at = trainer.count
    t_save = time.perf_counter()
    saver.save(step_at, {"config": cfg.to_dict(), "bench": True})
    call_s = time.perf_counter() - t_save
    overlap = []
    while True:
        overlap.append(timed_step())
        if not saver.busy:
            break
    overlap.append(timed_step())  # the step after: updates held during the last one show here
    stats = saver.wait()
    trainer.finish()
    save_peak = mon.peak
    loop_extra = max(0.0, sum(overlap) - step_s * len(overlap))
    path = stats.path
    size = du(path)
    print(f"background save: {stats.write_s:.1f}s total ({size / 1e9:.2f} GB, {size / 1e9 / stats.write_s:.2f} GB/s), "
          f"save() {call_s * 1e3:.1f} ms, updates held {stats.held_s:.2f}s, {len(overlap)} steps overlapped: "
          f"{[round(x, 2) for x in overlap]} -> loop lost {loop_extra:.2f}s; peak RSS +{save_peak - base_peak:.2f} GB",
          flush=True)

    # synchronous save, loop paused (end of run / signal)
    sync_s = sync_extra = None
    if not args.quick:
        before_sync = rss_gb()
        mon.reset()
        t = time.perf_counter()
        saver.save(trainer.count, {"config": cfg.to_dict()}, wait=True)
        sync_s = time.perf_counter() - t
        sync_extra = mon.peak - before_sync
        print(f"paused save: {sync_s:.1f}s, peak RSS +{sync_extra:.2f} GB", flush=True)
    saver.close()

    # restore (cold: files evicted from the page cache)
    evict(path)
    before_restore = rss_gb()
    mon.reset()
    t = time.perf_counter()
    ckr.restore_into(path, trainer.store, trainer.opt)
    restore_s = time.perf_counter() - t
    restore_extra = mon.peak - before_restore
    print(f"restore: {restore_s:.1f}s ({size / 1e9 / restore_s:.2f} GB/s), peak RSS +{restore_extra:.2f} GB",
          flush=True)
    mon.close()
    if hasattr(trainer, "close"):
        trainer.close()

    result = {
        "name": name, "config": args.config, "overrides": args.set, "mode": args.mode,
        "compute_s_per_step": args.compute_s if args.mode == "host" else None,
        "params": trainer.store.num_params(), "host_store_gb": store_gb, "checkpoint_gb": size / 1e9,
        "compute_dtype": cfg.train.compute_dtype, "batch_size": cfg.train.batch_size, "seq_len": cfg.data.seq_len,
        "baseline_step_s": step_s, "baseline_steps_s": base,
        "save_call_s": call_s, "held_s": stats.held_s, "loop_extra_s": loop_extra,
        "overlapped_steps_s": overlap, "save_total_s": stats.write_s,
        "save_gb_per_s": size / 1e9 / stats.write_s, "save_sync_s": sync_s,
        "save_peak_extra_gb": save_peak - base_peak, "save_sync_peak_extra_gb": sync_extra,
        "restore_s": restore_s, "restore_gb_per_s": size / 1e9 / restore_s,
        "restore_peak_extra_gb": restore_extra,
        "rss_before_build_gb": rss0, "baseline_peak_rss_gb": base_peak,
        "group_save_s": stats.group_s,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "device": device,
                    "mem_total_gb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9,
                    "checkpoint_dir": root},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"bench_checkpoint_{name}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
