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
