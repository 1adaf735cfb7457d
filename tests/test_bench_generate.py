"""``experiments/bench_generate.py --tiny`` runs on the CPU: prefill and decode reported apart for resident and
streamed (int8) weights, with the machine's rates measured in the same run and each row's bar figure."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_generate_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_generate", os.path.join(ROOT, "experiments",
                                                                                  "bench_generate.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    res = bench.main(["--tiny", "--batches", "2", "--int8", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    rates = res["rates"]
    assert rates["gpu_read_bytes_s"] > 0 and rates["h2d_bytes_s"] > 0
    by_mode = {r["weights"]: r for r in res["rows"]}
    assert set(by_mode) == {"resident", "streamed"} and by_mode["streamed"]["int8"]
    for r in res["rows"]:
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["decode_steps"] == 3
    assert by_mode["resident"]["frac_of_bound"] > 0 and by_mode["streamed"]["x_link"] > 0
    assert by_mode["streamed"]["weights_streamed_gb"] > 0 and by_mode["resident"]["weights_streamed_gb"] == 0
