"""Aggregate host->GPU and GPU->host bandwidth when every GPU streams at once, and an NVLink psum (run on a multi-GPU kind).
Its figures: docs/design.md section 5.

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python experiments/probes/probe_multi_gpu.py
"""
import time, jax, jax.numpy as jnp, numpy as np
from jax.sharding import SingleDeviceSharding as S
devs = jax.devices()
n = 1 << 28  # 1 GiB of fp32
srcs = [jax.device_put(np.ones(n, np.float32), S(d, memory_kind="pinned_host")) for d in devs]
jax.block_until_ready(srcs)
def go(ds):
    outs = [jax.device_put(srcs[i], S(devs[i], memory_kind="device")) for i in ds]
    jax.block_until_ready(outs); return outs
for ds in ([0], list(range(len(devs)))):
    go(ds)
    t = time.perf_counter(); reps = 5
    for _ in range(reps): go(ds)
    dt = (time.perf_counter() - t) / reps
    print(f"GPUs {ds}: {len(ds) * 4 * n / dt / 1e9:.1f} GB/s aggregate H2D ({4 * n / dt / 1e9:.1f} per GPU)")
# d2h concurrently
dsrc = [jax.device_put(np.ones(n, np.float32), d) for d in devs]
def back(ds):
    outs = [jax.device_put(dsrc[i], S(devs[i], memory_kind="pinned_host")) for i in ds]
    jax.block_until_ready(outs)
for ds in ([0], list(range(len(devs)))):
    back(ds); t = time.perf_counter()
    for _ in range(5): back(ds)
    dt = (time.perf_counter() - t) / 5
    print(f"GPUs {ds}: {len(ds) * 4 * n / dt / 1e9:.1f} GB/s aggregate D2H")
# all-reduce of a 1 GiB fp32 gradient over the GPUs
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(devs), ("d",))
x = jax.device_put(jnp.ones((len(devs), n // 4), jnp.float32), NamedSharding(mesh, P("d")))
f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
f(x).block_until_ready(); t = time.perf_counter()
for _ in range(10): y = f(x)
y.block_until_ready(); dt = (time.perf_counter() - t) / 10
print(f"psum of {n // 4 * 4 / 2**30:.2f} GiB per GPU over {len(devs)} GPUs: {dt * 1e3:.1f} ms ({n // 4 * 4 / dt / 1e9:.0f} GB/s algbw)")
