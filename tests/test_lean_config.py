"""The lean configuration (issue 29): >= 22B parameters with fp32 master weights planned on the 128 GiB /
80 GB H100 machine at <= 4.9 host bytes/param all-in, with room to spare on both sides."""
from __future__ import annotations

from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan
from megatrain_jax.plan.machine import target_machine


def test_lean_22b_plans_under_five_host_bytes_per_param():
    cfg = load_config("configs/lean-22b.yaml")
    m = target_machine(gpu_memory_gb=80, host_memory_gb=128, cpu_cores=16)
    p = make_plan(cfg, m, _modes=False)
    assert p.verdict() is None
    assert p.params >= 22e9 and p.host_bytes_per_param <= 4.9, (p.params, p.host_bytes_per_param)
    assert p.host_need <= 0.92 * p.host_limit  # >= 8% headroom on the host
    assert p.gpu_need <= p.gpu_budget
    d = p.decisions
    # the update on the GPU: no gradient, slab or bf16 weight copy waits on the host
    assert d["update_on"] == "device" and d["stream_copy"] == "device"
    assert d["grad_hold"] not in ("pinned_host", "host_fp32", "host_bf16")
    assert not any("slabs" in r.what or "bf16 streaming copy" in r.what for r in p.rows if r.where == "host")
