"""The attention paths at gpt-oss's shape, forward + backward: what the sinks cost (attention.py).

    python experiments/bench_attention_sinks.py [--batch 1] [--seq 4096] [--out DIR]

64 query / 8 kv heads of head_dim 64, bf16, causal, full and window 128: cuDNN without sinks (what a
sink-free model of this shape gets), the blockwise online-softmax path with sinks (what gpt-oss gets
beyond 1024 tokens) and without, and the plain XLA path with sinks. Each: median of 10 timed runs of
value_and_grad after 2 warm-ups; TFLOP/s counts the visible (query, key) pairs only.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.attention import attention


def visible_pairs(t: int, window: int | None) -> int:
    if window is None:
        return t * (t + 1) // 2
    return sum(min(i + 1, window) for i in range(t))


def bench(impl: str, sinks: bool, window, b: int, t: int, n: int = 64, k: int = 8, d: int = 64) -> dict:
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
    kk = jax.random.normal(ks[1], (b, t, k, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, k, d), jnp.bfloat16)
    s = jax.random.normal(ks[3], (n,), jnp.float32) if sinks else None

    def loss(q, kk, v, s):
        return jnp.sum(attention(q, kk, v, window=window, impl=impl, sinks=s).astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2) + ((3,) if sinks else ())))
    for _ in range(2):
        jax.block_until_ready(f(q, kk, v, s))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, kk, v, s))
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    flops = 2 * 2 * b * n * d * visible_pairs(t, window) * 3.5  # qk and pv, forward + backward (2.5x)
    return {"impl": impl, "sinks": sinks, "window": window, "batch": b, "seq": t, "ms": round(ms, 3),
            "tflops": round(flops / ms / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for window in (None, 128):
        for impl, sinks in (("cudnn", False), ("xla_blockwise", True), ("xla_blockwise", False), ("xla", True)):
            try:
                r = bench(impl, sinks, window, a.batch, a.seq)
            except Exception as e:  # noqa: BLE001 - one path failing does not hide the others
                r = {"impl": impl, "sinks": sinks, "window": window, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(r), flush=True)
            rows.append(r)
    if a.out:
        with open(os.path.join(a.out, "attention_sinks.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
