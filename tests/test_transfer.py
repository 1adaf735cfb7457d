"""Host <-> device paths: the dma_map wrapper falls back per buffer, and data arrives intact."""
import jax
import ml_dtypes
import numpy as np

from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.transfer import Transfers


def test_dma_map_failure_falls_back_to_pinned_copies():
    x = Transfers(jax.devices()[0], mode="dma_map")  # the CPU backend refuses dma_map
    buf = alloc_aligned(1000, np.uint16)
    want = np.arange(1000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    buf[:] = want.view(np.uint16)
    x.register("g", buf.view(ml_dtypes.bfloat16))
    assert "g" in x._fallback and x.fallback_reason and "dma_map failed" in x.fallback_reason
    out = np.asarray(x.to_device("g", buf.view(ml_dtypes.bfloat16))).astype(np.float32)
    np.testing.assert_array_equal(out, want.astype(np.float32))
    # a host write is seen only after host_written refreshes the pinned copy
    buf[:] = np.zeros(1000, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    x.host_written("g", buf.view(ml_dtypes.bfloat16))
    assert not np.asarray(x.to_device("g", buf.view(ml_dtypes.bfloat16))).astype(np.float32).any()
    x.close()
    assert not x._fallback


def test_gradients_come_back_through_pinned_host_memory():
    x = Transfers(jax.devices()[0])
    g = jax.device_put(np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    h = x.to_host(g)
    assert h.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(x.host_view(h), np.asarray(g))
    back = x.reload(x.offload(g))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(g))


def test_a_write_back_from_one_of_several_gpus_takes_that_gpus_direct_dma_not_the_pinned_pool():
    """A replicated device update (several GPUs, optax) writes each group back from one GPU's copy. Through the
    pinned path that stages a whole group in XLA's pinned pool, which the plan does not count (the 110B on four
    H200s ran out of it, bench_memory_plan.py); it must be the GPU's own direct DMA into the registered store."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import ctypes, os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        import jax, numpy as np
        from jax.sharding import Mesh
        from megatrain_jax.optim.host import alloc_aligned
        from megatrain_jax.transfer import Transfers

        devs = jax.devices()[:4]
        x = Transfers(devs, mesh=Mesh(np.array(devs), ("data",)))
        x.on_gpu, x.mode = True, "dma_map"  # as on GPUs: the store registered, a driver DMA per device
        used = []

        class FakeDirect:  # the driver's DtoH copy, done by memmove when waited for
            def __init__(self, dev_id):
                self.dev_id = dev_id
            def start(self, dst_ptr, src_ptr, nbytes):
                used.append(self.dev_id)
                return lambda: ctypes.memmove(dst_ptr, src_ptr, nbytes)

        x._directs = {d.id: FakeDirect(d.id) for d in devs}
        def no_pinned(a):
            raise AssertionError("staged through XLA's pinned pool")
        x.to_host = no_pinned
        dst = alloc_aligned(4096, np.float32)
        x._mapped.append((dst.ctypes.data, dst.nbytes))
        src = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
        x.copy_into(jax.device_put(src, devs[2]), dst)
        assert used == [devs[2].id], used
        assert np.array_equal(dst, src)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
