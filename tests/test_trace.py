"""The step timeline (trace.py): an operation whose result was consumed before its watcher reached it keeps
its bar, marked unobserved, and is charged no wait (the traced step's d2h lane went missing on a loaded 2-core
machine when the host update deleted every gradient copy first)."""
import jax.numpy as jnp

from megatrain_jax.trace import Tracer, exposed_times


def test_a_consumed_result_keeps_its_bar_without_length():
    tr = Tracer()
    gone = jnp.ones(4)
    gone.delete()  # as a host update does with a gradient copy it has read
    tr.watch("d2h", "grad 0", gone)
    tr.watch("d2h", "grad 1", jnp.ones(4))
    d2h = [e for e in tr.close() if e["lane"] == "d2h"]
    assert sorted(e["label"] for e in d2h) == ["grad 0", "grad 1"]
    (unseen,) = [e for e in d2h if e.get("observed") is False]
    assert unseen["label"] == "grad 0" and unseen["end"] == unseen["start"]
    (seen,) = [e for e in d2h if "observed" not in e]
    assert seen["end"] >= seen["start"]


def test_an_unobserved_operation_is_charged_no_wait():
    events = [{"lane": "compute", "start": 0.0, "end": 1.0}, {"lane": "compute", "start": 2.0, "end": 3.0},
              {"lane": "d2h", "start": 1.5, "end": 1.5, "observed": False}]
    out = exposed_times(events, 0.0, 3.0)
    assert out["dispatch"] == 1.0 and out["d2h"] == 0.0 and out["compute_busy"] == 2.0
    events[2].pop("observed")
    out = exposed_times(events, 0.0, 3.0)
    assert out["d2h"] == 1.0 and out["dispatch"] == 0.0
    # nor splits the compute lane: an unobserved compute bar inside the gap leaves it one wait
    events[2]["observed"] = False
    events.append({"lane": "compute", "start": 1.2, "end": 1.2, "observed": False})
    out = exposed_times(events, 0.0, 3.0)
    assert out["dispatch"] == 1.0 and out["compute_busy"] == 2.0
