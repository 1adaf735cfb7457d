"""The benchmarks' case runner (megatrain_jax/bench/runner.py, run by experiments/bench_memory_plan.py), which every
GPU figure in experiments/RESULTS.md comes through."""
import argparse

from megatrain_jax.bench.runner import run_case


def test_run_case_samples_memory_with_a_callers_own_options(tmp_path):
    """bench_data_parallel and bench_gpu_budgets pass a namespace without the case-ending options; the sampler
    must still run (it once died on the missing attribute and left the sampled peaks at 0)."""
    args = argparse.Namespace(steps=2, trace=False, out=str(tmp_path))
    r = run_case("tiny", "configs/tiny.yaml;train.batch_size=2;data.seq_len=32;train.devices=1", args)
    assert r["rc"] == 0, r["log_tail"]
    assert r["steps_done"] == 2
    assert r["sampled_peak_rss_gb"] > 0.05 and r["machine_used_peak_gb"] > 0
    assert "ended_by_bench" not in r
