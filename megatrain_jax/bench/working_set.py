"""The engine's compiled block backward (and forward) from abstract shapes, and the plan's working set for the same
block: ``experiments/probe_block_working_set.py`` prints one against the other on any backend, and
``tests/test_working_set.py`` holds the CPU coefficients to XLA:CPU's figures. Nothing is allocated: XLA's own
memory analysis of the executable (``Kernels``' block kernels, engine/kernels.py)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megatrain_jax import attention as attn
from megatrain_jax.config import ModelConfig
from megatrain_jax.engine.kernels import Kernels
from megatrain_jax.models.common import abstract_model, streamed_parts
from megatrain_jax.plan.sizes import Shapes, block_working_set
from megatrain_jax.templates import Layout


class Layouts:
    """What ``Kernels`` reads of a host store: each group's layout (no buffers)."""

    def __init__(self, parts):
        self.groups = {n: SimpleNamespace(layout=Layout(t), size=Layout(t).size) for n, t in parts.host_trees().items()}
        self.num_blocks = len(parts.blocks.kinds)

    def __getitem__(self, name):
        return self.groups[name]


def compiled_block(cfg: ModelConfig, seq: int, *, batch: int = 1, dtype: str = "bfloat16",
                   stream_dtype: str = "float32", docs: bool = False, layer: int = 0,
                   which: tuple[str, ...] = ("bwd", "fwd")) -> dict:
    """Memory analysis of the engine's block backward (and forward) for ``batch`` x ``seq`` tokens.
    ``stream_dtype``: what crosses PCIe (float32: train.stream_copy=device, the cast on the GPU)."""
    parts = streamed_parts(abstract_model(cfg))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    k = Kernels(parts, Layouts(parts), mesh, jnp.dtype(dtype), 1024, 0)
    dat, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=dat)
    shapes = jax.eval_shape(parts.aux_fn, tok, tok if docs else None)
    aux = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=dat if (a.ndim >= 1 and a.shape[0] == batch) else rep), shapes)
    size = k.store[f"block_{layer}"].size
    w = jax.ShapeDtypeStruct((size,), jnp.dtype(stream_dtype), sharding=rep)
    h = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), jnp.dtype(dtype), sharding=dat)
    g = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=dat)
    fwd, bwd = k._block_kernels(layer, aux)[:2]
    out = {}
    for name, fn, args in (("bwd", bwd, (w, h, aux, None, h, g)), ("fwd", fwd, (w, h, aux, None))):
        if name not in which:
            continue
        t0 = time.perf_counter()
        m = fn.lower(*args).compile().memory_analysis()
        out[name] = {"temp": int(m.temp_size_in_bytes), "args": int(m.argument_size_in_bytes),
                     "out": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes),
                     "compile_s": round(time.perf_counter() - t0, 1)}
    return out


def planned_block(cfg: ModelConfig, seq: int, *, batch: int = 1, dtype: str = "bfloat16", docs: bool = False,
                  backend: str | None = None) -> dict:
    """The plan's rows for the same block: ``block_working_set`` and the attention path's extra."""
    backend = backend or jax.default_backend()
    shapes = Shapes.of(cfg, batch, seq, dtype)
    info = attn.describe(cfg, seq, dtype, backend, batch=batch, doc_masking=docs)
    ws = block_working_set(shapes, batch * seq)
    return {"ws": ws, "attention": info["impl"], "attention_extra": info["extra_over_cudnn_bytes"],
            "total": ws + info["extra_over_cudnn_bytes"]}
