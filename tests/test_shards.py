"""engine/shards.py: a split group's shares back into the host store. With a direct DMA per GPU (on GPUs,
transfer.Transfers.direct_into) every share's copy starts before the first is waited for, so the GPUs' links run
together (one at a time, four H200s wrote a split update's state back at one link's rate: bench_data_parallel.py)."""
import subprocess
import sys
import textwrap


def test_copy_into_starts_every_share_before_waiting_and_lands_them_in_place():
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        import jax, numpy as np
        from jax.sharding import Mesh
        from megatrain_jax.engine.shards import Shards

        events = []

        def direct_into(share, dst):  # a fake DMA: copies when waited for, as the stream's sync completes it
            (dev,) = share.devices()
            events.append(("start", dev.id))
            def wait():
                events.append(("wait", dev.id))
                np.copyto(dst, np.asarray(share)[:dst.shape[0]])
            return wait

        mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
        for direct in (direct_into, None):
            events.clear()
            sh = Shards(mesh, 8, None, None, direct_into=direct)
            src = np.arange(70, dtype=np.float32)  # 70 values: shares of 24 (padded to 96), the last one short
            dst = np.zeros(70, np.float32)
            sh.copy_into(sh.to_device(src, sh.padded(70)), dst)
            assert np.array_equal(dst, src), direct
            if direct is not None:
                kinds = [k for k, _ in events]
                assert kinds == ["start"] * 3 + ["wait"] * 3, events  # (the 4th share is all padding: skipped)
                assert sorted(d for k, d in events if k == "start") == [0, 1, 2]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
