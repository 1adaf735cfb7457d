"""The plan searches (issue 27 item 1): every ``auto`` decision is chosen by enumerating candidates and
taking the fastest predicted step that fits the GPU budget and the host limit; a refusal names the
candidate that came closest and a fix that, applied, fits."""
import os

from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan, target_machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(config, *sets):
    return load_config(os.path.join(REPO, config), ["train.final_checkpoint=false", *sets])


def _target(gpu=None, host=None, **kw):
    return target_machine(gpu_memory_gb=gpu, host_memory_gb=host, cpu_cores=16, **kw)


def test_unconstrained_defaults_keep_their_decisions():
    """configs/7b.yaml (16 x 4096) and configs/qwen2.5-7b.yaml (128 x 1024) on an 80 GB H100 with a
    128 GiB host: the decisions of the rule-ordered plan, unchanged by the search."""
    m = _target(80, 137.4)
    want = {"configs/7b.yaml": dict(micro_batches=4, activations="device", grad_hold="gpu_fp32", stream_copy="host",
                                    update_on="host", keep_residuals=5, seq_tile=0, loss_chunk=4096),
            "configs/qwen2.5-7b.yaml": dict(micro_batches=4, activations="device", grad_hold="gpu_fp32",
                                            stream_copy="device", update_on="host", keep_residuals=0, seq_tile=0,
                                            loss_chunk=4096)}
    for config, decisions in want.items():
        p = make_plan(_cfg(config), m)
        assert p.verdict() is None, config
        o = p.options
        got = {k: getattr(o, k) for k in decisions}
        assert got == decisions, (config, got)
        assert (o.stream_io, o.boundary_every, o.grad_hold_gpu_groups) == (False, 1, 0)
