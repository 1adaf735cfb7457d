"""How fast is the chunked cross-entropy (value and gradient) against its three matmuls, by chunk size?

A Qwen3-8B timeline (bench_memory_plan.py --trace): the loss took 0.53 s per step for 3 x 2 x 65536 x 4096 x 151936
FLOPs (~460 TFLOPS) while the blocks ran at ~640. This times the engine's own ``chunked_cross_entropy``
under ``value_and_grad`` for one micro-batch (tokens x hidden) and vocabulary, by chunk size, next to
the three bare matmuls of one chunk repeated (the floor).

    PYTHONPATH=. python experiments/probe_loss_chunk.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import chunked_cross_entropy


def timed(f, *args, reps=5):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunks", default="2048,4096,8192,16384")
    args = ap.parse_args()
    T, H, V = args.tokens, args.hidden, args.vocab
    k = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(k[0], (1, T, H), jnp.float32)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (H, V), jnp.float32) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (1, T), 0, V)
    m = jnp.ones((1, T), jnp.float32)
    flops = 3 * 2 * T * H * V
    res = {"device": str(jax.devices()[0].device_kind), "tokens": T, "hidden": H, "vocab": V, "by_chunk": {}}
    for c in [int(s) for s in args.chunks.split(",")]:
        f = jax.jit(jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, y, m, c), argnums=(0, 1)))
        t = timed(f, x, w)
        xc = x.reshape(-1, H)[:c]

        def mm(xc, w):
            lg = jnp.dot(xc, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return jnp.dot(lg, w.T, preferred_element_type=jnp.float32), jnp.dot(xc.T, lg, preferred_element_type=jnp.float32)

        tm = timed(jax.jit(mm), xc, w) * (T // c)
        res["by_chunk"][c] = {"loss_s": t, "tflops": flops / t / 1e12, "three_matmuls_s": tm,
                              "matmul_tflops": flops / tm / 1e12}
        print(c, res["by_chunk"][c], flush=True)
    with open(os.path.join(args.out, "probe_loss_chunk.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
