"""Whether two trees give the GPU the same block computation: the StableHLO text of the engine's block forward and
backward (engine/kernels.py, one executable each, lowered from abstract shapes on this machine's backend), hashed,
for each config. Run it once per tree and compare the hashes; identical text means identical compute, so a speed
difference between the trees lies elsewhere (the host side, the machine).

    (cd TREE && PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/probe_hlo_identity.py configs/7b.yaml ...)

For example b5fa91a and 11e4477 gave byte-identical block forward and backward for configs/7b.yaml and
configs/qwen2.5-7b.yaml (4 x 4096 tokens, bf16, fp32 streamed weights) on the CPU backend.
"""
from __future__ import annotations

import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatrain_jax.bench.working_set import Layouts  # noqa: E402

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.engine.kernels import Kernels  # noqa: E402
from megatrain_jax.models.common import abstract_model, streamed_parts  # noqa: E402


def block_hlo(config: str, batch: int = 4, seq: int = 4096) -> dict[str, str]:
    """{"fwd": text, "bwd": text} of block 0 of ``config`` (2 layers, its own vocabulary)."""
    m = load_config(config, ["model.num_layers=2"]).model
    parts = streamed_parts(abstract_model(m))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    k = Kernels(parts, Layouts(parts), mesh, jnp.dtype("bfloat16"), 4096, 0)
    dat, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=dat)
    aux = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dat if (a.ndim >= 1 and a.shape[0] == batch) else rep),
        jax.eval_shape(parts.aux_fn, tok, None))
    size = k.store["block_0"].size
    w = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=rep)
    h = jax.ShapeDtypeStruct((batch, seq, m.hidden_size), jnp.bfloat16, sharding=dat)
    g = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=dat)
    fwd, bwd = k._block_kernels(0, aux)[:2]  # noqa: SLF001 - the engine's own executables
    return {"bwd": bwd.lower(w, h, aux, None, h, g).as_text(), "fwd": fwd.lower(w, h, aux, None).as_text()}


def main() -> None:
    for config in sys.argv[1:] or ["configs/7b.yaml", "configs/qwen2.5-7b.yaml"]:
        for name, text in block_hlo(config).items():
            print(config, name, hashlib.sha256(text.encode()).hexdigest()[:16], len(text), flush=True)


if __name__ == "__main__":
    main()
