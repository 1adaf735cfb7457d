"""Probe the physical limits that a host-streaming JAX trainer lives within.

Prints one line per figure: PCIe H2D/D2H bandwidth from pageable and pinned
host memory, matmul rates, transfer/compute overlap, CPU-side Adam throughput.
Its figures: docs/design.md sections 1 and 2.

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python experiments/probes/probe_device.py
"""
import os, time, json, sys
import numpy as np

def t(): return time.perf_counter()

import jax, jax.numpy as jnp
print("jax", jax.__version__, "devices", jax.devices(), "cpu", jax.devices("cpu")[:1], flush=True)
gpu = jax.devices()[0]
cpu = jax.devices("cpu")[0]
try:
    print("memory kinds", [m.kind for m in gpu.addressable_memories()], flush=True)
except Exception as e:
    print("memory kinds err", e)
from jax.sharding import SingleDeviceSharding
dev_s = SingleDeviceSharding(gpu, memory_kind="device")
pin_s = SingleDeviceSharding(gpu, memory_kind="pinned_host")
res = {}

N = 1 << 28  # 256M floats = 1 GiB
host = np.random.default_rng(0).standard_normal(N, dtype=np.float32)

def bw(name, fn, nbytes, reps=5):
    fn()  # warm
    ts = []
    for _ in range(reps):
        s = t(); fn(); ts.append(t() - s)
    g = nbytes / min(ts) / 1e9
    res[name] = round(g, 2)
    print(f"{name}: {g:.1f} GB/s (best of {reps}, {nbytes/2**30:.2f} GiB)", flush=True)

bw("h2d_numpy_pageable", lambda: jax.device_put(host, gpu).block_until_ready(), host.nbytes)
pinned = jax.device_put(host, pin_s); pinned.block_until_ready()
bw("h2d_pinned_host", lambda: jax.device_put(pinned, dev_s).block_until_ready(), host.nbytes)
on_dev = jax.device_put(pinned, dev_s); on_dev.block_until_ready()
bw("d2h_to_pinned_host", lambda: jax.device_put(on_dev, pin_s).block_until_ready(), host.nbytes)
bw("d2h_to_numpy", lambda: np.asarray(jax.device_put(on_dev, gpu)+0), host.nbytes, reps=3)
cpu_arr = jax.device_put(host, cpu); cpu_arr.block_until_ready()
bw("h2d_from_cpu_device_array", lambda: jax.device_put(cpu_arr, gpu).block_until_ready(), host.nbytes)
# many smaller transfers (per-tensor granularity of a 7B layer ~ 64 MB chunks)
chunks = [jax.device_put(host[i*(N//16):(i+1)*(N//16)], pin_s) for i in range(16)]
jax.block_until_ready(chunks)
bw("h2d_pinned_16x64MB", lambda: jax.block_until_ready([jax.device_put(c, dev_s) for c in chunks]), host.nbytes)
# bidirectional at once
def bidir():
    a = jax.device_put(pinned, dev_s); b = jax.device_put(on_dev, pin_s); jax.block_until_ready((a, b))
bw("bidir_pinned_total", bidir, 2 * host.nbytes)

# matmul rates
for dt, prec in [(jnp.bfloat16, None), (jnp.float32, None), (jnp.float32, "highest")]:
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), dt); b = jax.random.normal(jax.random.key(2), (n, n), dt)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=prec))
    f(a, b).block_until_ready()
    s = t(); 
    for _ in range(10): c = f(a, b)
    c.block_until_ready(); el = (t() - s) / 10
    name = f"matmul_{jnp.dtype(dt).name}_{prec or 'default'}_tflops"
    res[name] = round(2 * n**3 / el / 1e12, 1); print(name, res[name], flush=True)

# overlap: compute-only, transfer-only, both
n = 8192
a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
@jax.jit
def chain(a):
    def body(i, x): return (x @ a) * 0.01
    return jax.lax.fori_loop(0, 40, body, a)
chain(a).block_until_ready()
big = jax.device_put(np.concatenate([host] * 4), pin_s); big.block_until_ready()
s = t(); chain(a).block_until_ready(); tc = t() - s
s = t(); jax.device_put(big, dev_s).block_until_ready(); tx = t() - s
s = t(); r1 = chain(a); r2 = jax.device_put(big, dev_s); jax.block_until_ready((r1, r2)); tb = t() - s
res.update(overlap_compute_s=round(tc, 3), overlap_xfer_s=round(tx, 3), overlap_both_s=round(tb, 3))
print(f"overlap: compute {tc:.3f}s xfer {tx:.3f}s both {tb:.3f}s (perfect overlap = {max(tc,tx):.3f}, none = {tc+tx:.3f})", flush=True)
# overlap with D2H
s = t(); r1 = chain(a); r2 = jax.device_put(on_dev, pin_s); jax.block_until_ready((r1, r2)); tb2 = t() - s
s = t(); jax.device_put(on_dev, pin_s).block_until_ready(); tx2 = t() - s
print(f"overlap d2h: compute {tc:.3f}s xfer {tx2:.3f}s both {tb2:.3f}s", flush=True)
res.update(overlap_d2h_both_s=round(tb2, 3), d2h_only_s=round(tx2, 3))
del big, chunks

# CPU Adam on host
import optax
P = 1 << 28  # 256M params
opt = optax.adamw(1e-4)
params = jax.device_put(np.ones(P, np.float32), cpu)
grads = jax.device_put(np.full(P, 0.01, np.float32), cpu)
state = jax.jit(opt.init)(params)
@jax.jit
def step(p, g, s):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
step_d = jax.jit(step.__wrapped__ if hasattr(step, "__wrapped__") else step, donate_argnums=(0, 2))
p2, s2 = step_d(params, grads, state); jax.block_until_ready(p2)
ts = []
for _ in range(3):
    s = t(); p2, s2 = step_d(p2, grads, s2); jax.block_until_ready(p2); ts.append(t() - s)
res["cpu_adamw_jax_Mparam_per_s"] = round(P / min(ts) / 1e6, 1)
print("cpu adamw (jax cpu backend):", res["cpu_adamw_jax_Mparam_per_s"], "M params/s", flush=True)
# pinned_host compute_on (host offload of optimizer on gpu client)
try:
    from jax.experimental.compute_on import compute_on
    pp = jax.device_put(np.ones(P, np.float32), pin_s)
    gg = jax.device_put(np.full(P, 0.01, np.float32), pin_s)
    mm = jax.device_put(np.zeros(P, np.float32), pin_s)
    vv = jax.device_put(np.zeros(P, np.float32), pin_s)
    def _hadam(p, g, m, v):
        m = 0.9 * m + 0.1 * g; v = 0.999 * v + 0.001 * g * g
        return p - 1e-4 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * p), m, v
    host = jax.memory.Space.Host
    hadam = compute_on(_hadam, compute_type="device_host", out_memory_spaces=(host, host, host))
    f = jax.jit(hadam, out_shardings=(pin_s, pin_s, pin_s), donate_argnums=(0, 2, 3))
    pp, mm, vv = f(pp, gg, mm, vv); jax.block_until_ready(pp)
    ts = []
    for _ in range(3):
        s = t(); pp, mm, vv = f(pp, gg, mm, vv); jax.block_until_ready(pp); ts.append(t() - s)
    res["compute_on_host_adam_Mparam_per_s"] = round(P / min(ts) / 1e6, 1)
    print("compute_on device_host adam:", res["compute_on_host_adam_Mparam_per_s"], "M params/s", flush=True)
except Exception as e:
    print("compute_on failed:", type(e).__name__, str(e)[:300], flush=True)

# host memory bandwidth (numpy copy)
dst = np.empty_like(host)
s = t(); np.copyto(dst, host); el = t() - s
res["host_memcpy_GBps_1thread"] = round(2 * host.nbytes / el / 1e9, 1)
print("host memcpy 1 thread:", res["host_memcpy_GBps_1thread"], "GB/s", flush=True)
print("os cpus", os.cpu_count())
print("RESULT", json.dumps(res))
out = os.environ.get("OUT")
if out:
    open(os.path.join(out, "probe.json"), "w").write(json.dumps(res, indent=1))
