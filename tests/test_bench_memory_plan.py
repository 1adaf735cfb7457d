"""The benchmark's case runner (experiments/bench_memory_plan.py), which every GPU figure in experiments/RESULTS.md comes through."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
from bench_memory_plan import run_case  # noqa: E402


def test_run_case_samples_memory_with_a_callers_own_options(tmp_path):
    """bench_data_parallel and bench_gpu_budgets pass a namespace without the case-ending options; the sampler
    must still run (it once died on the missing attribute and left the sampled peaks at 0)."""
    args = argparse.Namespace(steps=2, trace=False, out=str(tmp_path))
    r = run_case("tiny", "configs/tiny.yaml;train.batch_size=2;data.seq_len=32;train.devices=1", args)
    assert r["rc"] == 0, r["log_tail"]
    assert r["steps_done"] == 2
    assert r["sampled_peak_rss_gb"] > 0.05 and r["machine_used_peak_gb"] > 0
    assert "ended_by_bench" not in r
