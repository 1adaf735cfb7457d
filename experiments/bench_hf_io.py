"""Time Hugging Face import and export at Llama-2-7B shape, and measure peak host memory.

    python experiments/bench_hf_io.py                 # the full 7B (needs ~45 GB RAM, ~30 GB disk)
    python experiments/bench_hf_io.py --layers 2      # same shapes, 2 blocks: a quick check on a laptop

1. Writes a random Llama-2-7B-shaped checkpoint as bf16 safetensors shards (5 GB max each, plus
   ``model.safetensors.index.json``) with megatrain-jax's streaming writer: no torch, and never more
   than one tensor in memory (values are slices of one random pool).
2. Drops those files from the page cache (``posix_fadvise``), then times ``load_hf_into_store`` with
   ``bf16_stream=True`` (fp32 master + bf16 streaming copy: 6 bytes per parameter).
3. Times ``export_hf(..., dtype="bfloat16")`` of that store.

Peak RSS per phase comes from two sources: the kernel's high-water mark ``VmHWM`` (reset before each
phase through ``/proc/self/clear_refs``; ``ru_maxrss`` is the whole process's) and a thread that
samples ``VmRSS`` every 20 ms. The claim checked: import peaks at about the store's size (no second
copy of the model), export adds about one tensor. Results go to ``$OUT/bench_hf_io.json`` when
``$OUT`` is set, else ``experiments/results/bench_hf_io[_L<layers>].json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # only abstract shapes are needed; keep accelerators out of it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.nnx  # noqa: E402,F401  (imported up front so that the import phase measures the loader only)
import numpy as np  # noqa: E402

from megatrain_jax.bench.random_hf import LLAMA2_7B, drop_from_page_cache, write_random_checkpoint  # noqa: E402
from megatrain_jax.config import ModelConfig  # noqa: E402
from megatrain_jax.hf import export_hf, load_hf_into_store  # noqa: E402

GB = 1e9


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Peak VmRSS of this process over a phase (sampled), plus the kernel's VmHWM for it."""

    def __init__(self, period: float = 0.02):
        self.period, self.peak, self._stop = period, 0, threading.Event()

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.start_rss = _status("VmRSS")
        self.peak = self.start_rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        self.t0 = time.perf_counter()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("VmRSS"))
            time.sleep(self.period)

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _status("VmRSS"))
        self.hwm = _status("VmHWM") if self.hwm_reset else None

    def report(self) -> dict:
        return {"wall_s": round(self.wall, 2), "rss_start_gb": round(self.start_rss / GB, 3),
                "rss_peak_sampled_gb": round(self.peak / GB, 3),
                "rss_hwm_gb": None if self.hwm is None else round(self.hwm / GB, 3),
                "end_rss_gb": round(_status("VmRSS") / GB, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real Llama-2-7B)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--warm", action="store_true", help="do not drop the source files from the page cache")
    args = ap.parse_args()

    c = dict(LLAMA2_7B, num_hidden_layers=args.layers)
    work = tempfile.mkdtemp(prefix="bench_hf_io-", dir=args.workdir)
    src, dst = os.path.join(work, "hf"), os.path.join(work, "export")
    os.makedirs(src)
    result: dict = {"model": "llama2-7b-shape", "layers": args.layers, "host": platform.node(),
                    "cpus": os.cpu_count(), "shard_gb": args.shard_gb}
    try:
        with RssSampler() as ph:
            nbytes, check = write_random_checkpoint(src, c, int(args.shard_gb * GB))
        result["write_source"] = {**ph.report(), "bytes_gb": round(nbytes / GB, 3)}
        print(f"source checkpoint: {nbytes / GB:.2f} GB bf16 in {ph.wall:.1f}s", flush=True)
        pool, offsets = check["pool"], check["offsets"]
        del check
        if not args.warm:
            drop_from_page_cache(src)

        cfg = ModelConfig(from_hf=src)
        with RssSampler() as ph:
            parts, store = load_hf_into_store(cfg, bf16_stream=True)
        store_gb = store.nbytes() / GB
        result["params"] = store.num_params()
        result["store_gb"] = round(store_gb, 3)
        result["import"] = {**ph.report(), "gb_per_s": round(nbytes / GB / ph.wall, 3),
                            "peak_over_store": round((ph.hwm or ph.peak) / GB / store_gb, 3),
                            "peak_minus_start_minus_store_gb": round(((ph.hwm or ph.peak) - ph.start_rss) / GB - store_gb, 3)}
        print(f"import: {ph.wall:.1f}s, store {store_gb:.2f} GB, peak RSS {ph.peak / GB:.2f} GB "
              f"(hwm {None if ph.hwm is None else round(ph.hwm / GB, 2)})", flush=True)
        # spot-check values (bf16 -> fp32 upcast is exact; kernels are transposed)
        g = store["block_0"]
        leaf = next(x for x in g.layout.leaves if x.path == "mlp/down_proj/kernel")
        h, f = c["hidden_size"], c["intermediate_size"]
        off = offsets["model.layers.0.mlp.down_proj.weight"]
        want = pool[off:off + h * f].reshape(h, f).astype(np.float32).T
        assert np.array_equal(g.master[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape), want)
        del pool, want

        with RssSampler() as ph:
            export_hf(store, cfg, dst, dtype="bfloat16", max_shard_bytes=int(args.shard_gb * GB))
        out_bytes = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst) if f.endswith(".safetensors"))
        result["export"] = {**ph.report(), "bytes_gb": round(out_bytes / GB, 3), "gb_per_s": round(out_bytes / GB / ph.wall, 3),
                            "peak_minus_start_gb": round(((ph.hwm or ph.peak) - ph.start_rss) / GB, 3)}
        print(f"export: {ph.wall:.1f}s, {out_bytes / GB:.2f} GB, peak RSS {ph.peak / GB:.2f} GB", flush=True)
        result["ru_maxrss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3)
        # the export of an unchanged bf16 import is byte-identical to the source (same tensor order aside)
        from megatrain_jax.hf import index_checkpoint

        a, b = index_checkpoint(src), index_checkpoint(dst)
        result["export_tensors_match_source"] = sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "bench_hf_io.json" if os.environ.get("OUT") else f"bench_hf_io{'' if args.layers == 32 else f'_L{args.layers}'}.json"
    path = os.path.join(out_dir, name)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
