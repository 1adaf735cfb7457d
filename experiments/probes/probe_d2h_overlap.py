"""Does a GPU->host copy overlap compute, and does issue order matter? jit-with-pinned-output vs
device_put to pinned_host, issued before or after queued matmuls. Prints wall times (ms).
Its figures: docs/design.md section 2."""
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

dev = jax.devices()[0]
pin = SingleDeviceSharding(dev, memory_kind="pinned_host")
x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
mm = jax.jit(lambda a: (a @ a) * 0.5)
jit_out = jax.jit(lambda v: v, out_shardings=pin)


def matmuls(n=24):
    y = a
    for _ in range(n):
        y = mm(y)
    return y


def timed(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return round(sorted(ts)[len(ts) // 2], 1)


res = {
    "matmuls_alone": timed(lambda: matmuls().block_until_ready()),
    "jit_d2h_alone": timed(lambda: jit_out(x).block_until_ready()),
    "device_put_d2h_alone": timed(lambda: jax.device_put(x, pin).block_until_ready()),
    "jit_d2h_then_matmuls": timed(lambda: jax.block_until_ready((jit_out(x), matmuls()))),
    "matmuls_then_jit_d2h": timed(lambda: jax.block_until_ready(list(reversed((matmuls(), jit_out(x)))))),
    "device_put_d2h_then_matmuls": timed(lambda: jax.block_until_ready((jax.device_put(x, pin), matmuls()))),
    "matmuls_then_device_put_d2h": timed(lambda: jax.block_until_ready(list(reversed((matmuls(), jax.device_put(x, pin)))))),
}
# how long until the copy itself is done, when issued after queued matmuls
def copy_ready_after_matmuls(put):
    y = matmuls()
    t = time.perf_counter()
    c = put()
    c.block_until_ready()
    dt = (time.perf_counter() - t) * 1e3
    y.block_until_ready()
    return dt
res["jit_copy_ready_ms_when_issued_after_matmuls"] = round(min(copy_ready_after_matmuls(lambda: jit_out(x)) for _ in range(3)), 1)
res["device_put_copy_ready_ms_when_issued_after_matmuls"] = round(min(copy_ready_after_matmuls(lambda: jax.device_put(x, pin)) for _ in range(3)), 1)
print("D2H_PROBE", res)
