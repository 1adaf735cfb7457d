"""Which stage of starting JAX on a GPU makes the fixed ~2.5 GB anonymous host mapping, and whether an
environment setting removes it.

The smaps probe (probe_host_runtime.py) found one 2.52 GB resident anonymous mapping in every GPU training process
(a tiny model's too): a fixed runtime cost that is 0.33 bytes/param at 7.6B. This runs a child per
variant (environment), steps it through JAX's start-up (import, backend, a jit, a pinned_host copy, a
cuDNN attention call, numba's threads) and records RssAnon/RssFile/RssShmem and the largest anonymous
mappings after each stage.

    PYTHONPATH=. python experiments/probe_runtime_stages.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = {
    "default": {},
    "module_loading_eager": {"CUDA_MODULE_LOADING": "EAGER"},
    "autotune_0": {"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
    "no_command_buffer": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "no_preallocate": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "cuda_platform_only": {"JAX_PLATFORMS": "cuda"},
}


def snapshot() -> dict:
    st = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                st[k] = round(int(v.split()[0]) * 1024 / 1e9, 3)
    anon, name, rng, size = [], "?", "", 0
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                name = parts[5] if len(parts) > 5 else "[anon]"
                rng = parts[0]
            elif parts[0] == "Size:":
                size = int(parts[1]) * 1024
            elif parts[0] == "Rss:" and name == "[anon]":
                anon.append((round(int(parts[1]) * 1024 / 1e9, 3), round(size / 1e9, 3), rng))
    anon.sort(reverse=True)
    st["largest_anon_rss_size_gb"] = anon[:3]
    return st


def child() -> None:
    out = {}

    def mark(stage):
        out[stage] = snapshot()
        print(stage, out[stage], flush=True)

    import numpy as np
    mark("numpy")
    import jax
    import jax.numpy as jnp
    mark("import_jax")
    devs = jax.devices()
    mark(f"backend ({devs[0].platform})")
    x = jnp.ones((1024,), jnp.float32).block_until_ready()
    mark("first_array")
    f = jax.jit(lambda a, b: (a @ b).astype(jnp.float32).sum())
    a = jnp.ones((4096, 4096), jnp.bfloat16)
    f(a, a).block_until_ready()
    mark("jit_matmul")
    try:
        s = jax.sharding.SingleDeviceSharding(devs[0], memory_kind="pinned_host")
        h = jax.device_put(np.ones((1 << 26,), np.float32), s).block_until_ready()
        back = jax.device_put(h, devs[0]).block_until_ready()
        del h, back
        mark("pinned_host_256MB")
    except Exception as e:  # noqa: BLE001
        out["pinned_host_error"] = repr(e)
    try:
        q = jnp.ones((2, 1024, 8, 128), jnp.bfloat16)
        g = jax.jit(jax.grad(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                                                    implementation="cudnn").astype(jnp.float32).sum()))
        g(q).block_until_ready()
        mark("cudnn_attention_grad")
    except Exception as e:  # noqa: BLE001
        out["cudnn_error"] = repr(e)[:300]
    import numba

    @numba.njit(parallel=True, cache=False)
    def k(v):
        for i in numba.prange(v.size):
            v[i] = v[i] * 2.0

    k(np.ones(1 << 20, np.float32))
    mark("numba_parallel")
    del x
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if args.child:
        return child()
    res = {}
    for name in args.variants.split(","):
        env = dict(os.environ, **VARIANTS[name])
        p = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                           timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res[name] = {"env": VARIANTS[name], "rc": p.returncode,
                     "stages": json.loads(line[0][7:]) if line else None,
                     "stderr_tail": p.stderr[-1500:] if p.returncode else ""}
        last = list(res[name]["stages"].values())[-1] if res[name]["stages"] else None
        print(name, "rc", p.returncode, "last", last, flush=True)
    with open(os.path.join(args.out, "probe_runtime_stages.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
