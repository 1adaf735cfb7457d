"""``weights.Pace`` and the bounds the plan counts: the dispatching thread waits for the block ``queued`` back
(event order, no timing), and the plan chooses ``blocks_queued=1`` only where the usual pace does not fit."""
from __future__ import annotations

import os

from megatrain_jax.engine import weights
from megatrain_jax.engine.weights import Pace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(monkeypatch):
    events = []
    monkeypatch.setattr(weights.jax, "block_until_ready", lambda x: events.append(("wait", x)) or x)
    return events


def _dispatch(pace: Pace, events: list, n: int) -> None:
    for i in range(n):
        events.append(("dispatch", i))
        pace.dispatched(i)


def test_pace_waits_for_the_block_queued_back(monkeypatch):
    events = _record(monkeypatch)
    pace = Pace(2)
    _dispatch(pace, events, 5)
    # after block i is dispatched, block i-1 has been waited for: never more than 2 dispatched and not computed
    assert events == [("dispatch", 0), ("dispatch", 1), ("wait", 0), ("dispatch", 2), ("wait", 1),
                      ("dispatch", 3), ("wait", 2), ("dispatch", 4), ("wait", 3)]
    pace.reset()
    events.clear()
    pace.dispatched("a")
    assert events == []  # a new step starts with nothing queued


def test_pace_of_one_waits_for_each_block(monkeypatch):
    events = _record(monkeypatch)
    pace = Pace(1)
    _dispatch(pace, events, 3)
    assert events == [("dispatch", 0), ("wait", 0), ("dispatch", 1), ("wait", 1), ("dispatch", 2), ("wait", 2)]


def test_plan_takes_one_queued_block_only_where_two_do_not_fit():
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan
    from megatrain_jax.plan.machine import target_machine

    m = target_machine(gpu_memory_gb=80, host_memory_gb=128)
    cfg = os.path.join(ROOT, "configs/llama3.1-8b.yaml")
    plans = {b: make_plan(load_config(cfg, ["optim.clip_norm=1.0", f"train.gpu_memory_gb={b}"]), m) for b in (10, 24)}
    assert plans[24].verdict() is None and plans[24].options.blocks_queued == 2
    p10 = plans[10]
    assert p10.verdict() is None and p10.options.blocks_queued == 1
    assert any("blocks_queued=1" in n for n in p10.notes)
    # no candidate with the usual pace fitted: the retry was needed
    usual = [c for c in p10.found.candidates if c.blocks_queued == 2]
    assert usual and not any(c.fits for c in usual)
    assert not any(c.blocks_queued == 1 for c in plans[24].found.candidates)


def test_blocks_queued_below_one_is_refused_in_one_line():
    import pytest

    from megatrain_jax.errors import UserError
    from megatrain_jax.plan.options import EngineOptions

    with pytest.raises(UserError) as e:
        EngineOptions(blocks_queued=0)
    assert e.value.field == "blocks_queued" and "\n" not in str(e.value)
