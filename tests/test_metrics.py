"""metrics.jsonl and the TensorBoard event files hold the same figures."""
import glob
import json
import os
import struct

from megatrain_jax.metrics import MetricsWriter


def _events(folder):
    from tensorboardX.proto import event_pb2

    out = {}
    for path in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


def test_tensorboard_events_mirror_metrics_jsonl(tmp_path):
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    recs = [{"step": s, "loss": 5.0 - s, "grad_norm": 1.5, "lr": 1e-3 * s, "tokens_per_s": 1000.0 + s,
             "model_tflops": 0.5, "gpu_peak_gb": 3.25, "skipped": False} for s in (1, 2, 3)]
    for r in recs:
        w.write(r)
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == recs
    ev = _events(str(tmp_path / "tensorboard"))
    assert ev["train/loss"] == {1: 4.0, 2: 3.0, 3: 2.0} and ev["train/gpu_peak_gb"][2] == 3.25
    assert abs(ev["train/lr"][3] - 3e-3) < 1e-9 and set(ev) >= {"train/grad_norm", "train/tokens_per_s"}


def test_without_tensorboard_only_jsonl(tmp_path):
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"), tensorboard=False)
    w.write({"step": 1, "loss": 1.0})
    w.close()
    assert not (tmp_path / "tensorboard").exists()
