"""Sorted dispatch (ragged_dot) vs dense (every expert on every token) for the MoE layer's experts:
forward + backward of route + experts, jitted, median of N runs (``models/moe.py``'s two ``moe_impl``).

    python experiments/bench_moe.py cpu   # small shapes, fp32 (the 2-core dev machine)
    python experiments/bench_moe.py gpu   # OLMoE-1B-7B / Mixtral-like layer shapes, bf16
"""
from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models.moe import experts_dense, experts_sorted, route

SHAPES = {  # name: (tokens, hidden, expert width, experts, top-k)
    "cpu": [("small-8x2", 1024, 128, 64, 8, 2), ("small-32x8", 1024, 128, 64, 32, 8)],
    "gpu": [("mixtral-like-8x2", 4096, 1024, 3584, 8, 2), ("olmoe-64x8-4k", 4096, 2048, 1024, 64, 8),
            ("olmoe-64x8-16k", 16384, 2048, 1024, 64, 8)],
}


def bench(t, h, f, e, k, dtype, impl, reps):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(t, h)), dtype)
    wr = jnp.asarray(rng.normal(size=(h, e)) * h ** -0.5, dtype)
    ws = [jnp.asarray(rng.normal(size=s) * 0.02, dtype) for s in ((e, h, f), (e, h, f), (e, f, h))]
    fn = experts_sorted if impl == "sorted" else experts_dense

    def loss(x, wr, ws):
        weights, idx = route(x @ wr, k, True)
        return jnp.sum(fn(x, weights, idx, *ws).astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(x, wr, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, wr, ws))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(where: str) -> None:
    dtype = jnp.float32 if where == "cpu" else jnp.bfloat16
    reps = 5 if where == "cpu" else 20
    out = []
    for name, t, h, f, e, k in SHAPES[where]:
        row = {"shape": name, "T": t, "H": h, "F": f, "E": e, "k": k, "dtype": jnp.dtype(dtype).name,
               "backend": jax.default_backend()}
        for impl in ("sorted", "dense"):
            try:
                row[impl + "_ms"] = round(1e3 * bench(t, h, f, e, k, dtype, impl, reps), 2)
            except Exception as err:  # e.g. out of memory: say so, go on
                row[impl + "_ms"] = f"failed: {str(err).splitlines()[0][:200]}"
        out.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
