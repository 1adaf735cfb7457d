"""Is np.asarray of a pinned_host array a view of its buffer, or a copy, by dtype? (the 8B at 10 GB
with a pinned bf16 hold ran 8.6 GB over its plan while the fp32 hold had matched.) Prints, per dtype, whether the
numpy array shares the jax buffer's address and the process RSS growth over 16 reads of 256 MiB arrays kept alive."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


dev = jax.devices()[0]
host = SingleDeviceSharding(dev, memory_kind="pinned_host")
out = {"device": dev.device_kind}
n = 1 << 27  # 128M values
for name in ("float32", "bfloat16", "uint16"):
    dt = jnp.dtype(name)
    xs = [jax.device_put(jnp.zeros(n // (dt.itemsize // 2 if dt.itemsize > 2 else 1), dt), host) for _ in range(4)]
    jax.block_until_ready(xs)
    r0 = rss_gb()
    views = [np.asarray(x) for x in xs]
    same = [v.ctypes.data == x.unsafe_buffer_pointer() for v, x in zip(views, xs)]
    out[name] = {"shares_buffer": all(same), "rss_growth_gb": round(rss_gb() - r0, 3),
                 "bytes_each_gb": round(xs[0].nbytes / 1e9, 3)}
    del views, xs
print(json.dumps(out))
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(out, open(os.path.join(sys.argv[1], "probe_pinned_view.json"), "w"))
