"""Which array of the 110B lean step asks jit_grad_sqnorm for 10.1 GiB (a 110B run: RESOURCE_EXHAUSTED
there, 10842578432 bytes)? XLA's compiled memory analysis of the squared norm, both forms (a loop over slices, as
once tried in engine/kernels.py and reverted, and the whole-array sum the engine keeps), for the 110B's
groups in fp32 and bf16, on this GPU. H100 result: at most 394 KB of temporaries either way.

    PYTHONPATH=. python experiments/probe_sqnorm_temps.py [OUT_DIR]
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


ROW = 1 << 24


def sliced(g):
    """The squared norm summed over ROW-value slices in a loop and the tail."""
    rows = g.shape[0] // ROW

    def add(i, acc):
        return acc + jnp.sum(jnp.square(jax.lax.dynamic_slice_in_dim(g, i * ROW, ROW).astype(jnp.float32)))

    head = jax.lax.fori_loop(0, rows, add, jnp.zeros((), jnp.float32))
    return head + jnp.sum(jnp.square(g[rows * ROW:].astype(jnp.float32)))


SIZES = {"block_110b": 1_358_991_120, "head_110b": 1_245_716_480, "embed_110b": 1_245_708_288,
         "two_blocks_110b": 2 * 1_358_991_120, "embed_plus_head_110b": 2_491_424_768}


def main() -> None:
    out = {"device": jax.devices()[0].device_kind, "target_bytes": 10842578432}
    for name, n in SIZES.items():
        for dt in (jnp.float32, jnp.bfloat16):
            x = jax.ShapeDtypeStruct((n,), dt)
            for form, fn in (("rows", sliced), ("whole", lambda g: jnp.sum(jnp.square(g)))):
                try:
                    m = jax.jit(fn).lower(x).compile().memory_analysis()
                    rec = {"temp": m.temp_size_in_bytes, "arg": m.argument_size_in_bytes, "out": m.output_size_in_bytes}
                except Exception as e:  # noqa: BLE001
                    rec = {"error": str(e)[:300]}
                out[f"{name}/{np.dtype(dt).name}/{form}"] = rec
                print(name, np.dtype(dt).name, form, rec, flush=True)
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "probe_sqnorm_temps.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
