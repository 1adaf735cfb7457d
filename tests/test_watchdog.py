"""watchdog.py: a step that stops making progress ends the run with one line (exit 3) instead of hanging it."""
import os
import threading
import time

import pytest

from cli_runner import run_cli, sets
from megatrain_jax.config import load_config
from megatrain_jax.errors import UserError
from megatrain_jax.watchdog import FACTOR, FIRST_STEP_S, FLOOR_S, StallWatchdog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=32",
         "train.batch_size=4", "optim.schedule.warmup_steps=0", "train.log_every=1"]


def test_a_step_over_its_limit_is_reported_once_with_every_threads_stack(tmp_path):
    got, done = [], threading.Event()
    w = StallWatchdog(0.3, str(tmp_path), start_step=6, poll_s=0.05, on_stall=lambda m: (got.append(m), done.set()))
    w.beat(7)  # (the first step of this process: the next one has the fixed limit)
    assert done.wait(5.0), "the watchdog never fired"
    time.sleep(0.3)
    assert len(got) == 1 and "step 8 made no progress" in got[0] and "train.stall_timeout_s" in got[0]
    log = (tmp_path / "error.log").read_text()
    assert "step 8 stalled" in log and "watchdog.py" in log and "test_watchdog.py" in log  # every thread's stack


def test_steps_that_keep_beating_are_never_reported(tmp_path):
    got = []
    w = StallWatchdog(0.5, str(tmp_path), poll_s=0.05, on_stall=got.append)
    for s in range(1, 8):
        time.sleep(0.1)
        w.beat(s)
    w.close()
    time.sleep(0.2)
    assert got == [] and not (tmp_path / "error.log").exists()


def test_auto_limits_an_hour_until_the_pace_is_known_then_20x_the_longest_step(tmp_path):
    w = StallWatchdog(None, str(tmp_path), on_stall=lambda m: None)
    assert w.limit() == FIRST_STEP_S
    w.beat(1)  # the first step (compiling) does not set the pace
    assert w.limit() == FIRST_STEP_S
    w.longest = 0.0
    w.beat(2)
    assert w.limit() == FLOOR_S  # fast steps: never under the floor
    w.longest = 120.0
    assert w.limit() == FACTOR * 120.0
    w.close()
    fixed = StallWatchdog(30.0, str(tmp_path), on_stall=lambda m: None)
    assert fixed.limit() == FIRST_STEP_S  # the first step compiles, whatever the setting
    fixed.beat(1)
    assert fixed.limit() == 30.0
    fixed.close()
    fired = []
    off = StallWatchdog(0, str(tmp_path), on_stall=fired.append)
    assert off.thread is None
    time.sleep(0.2)
    assert fired == []


@pytest.mark.parametrize("bad", ["-1", "'soon'", "true"])
def test_a_bad_limit_is_refused_naming_the_field(bad):
    with pytest.raises(UserError) as e:
        load_config(os.path.join(REPO, "configs/tiny.yaml"), [f"train.stall_timeout_s={bad}"])
    assert e.value.field == "train.stall_timeout_s" and e.value.fix


def test_a_hung_step_ends_the_run_with_one_line_and_keeps_the_checkpoint(tmp_path, cli_env):
    """The CLI with a step that never returns (the test hook standing in for a GPU waiting in a collective for one
    that failed): exit 3 within the limit, one error line naming the field, the checkpoint before it intact."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = run_cli(["train", "configs/tiny.yaml", *sets(*SMALL, f"train.out_dir={out}", "train.steps=6",
                                                    "train.ckpt_every=2", "train.stall_timeout_s=3")],
                env=cli_env, hooks={"hang_in_step": 4}, timeout=240)
    assert r.rc == 3, r.stderr[-2000:]
    assert time.monotonic() - t0 < 200
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "train.stall_timeout_s: step 4 made no progress" in lines[0]
    assert os.path.isdir(out / "checkpoints" / "step_00000002")
    assert "step 4 stalled" in (out / "error.log").read_text()
