"""Ends a run whose step stops making progress, instead of letting it hang.

A GPU that fails inside a collective can leave the others waiting for it forever: in one run one of four H100s ran out of
memory in step 4 and the three others sat in XLA's rendezvous until the job's time limit, printing only warnings.
``StallWatchdog`` watches the training loop from a thread: when a step has run longer than its limit it writes every
thread's stack to ``out_dir/error.log``, prints one line that names the step, the limit and the setting, and ends the
process (exit 3). Committed checkpoints are untouched (a save in flight stays a ``.tmp`` that resume ignores).

The limit (``train.stall_timeout_s``): the first step (compilation, the first transfers) may take an hour whatever the
setting; after it, null (auto) is an hour for the second step and then 20 times the longest step so far (the first
excepted), at least 10 minutes; a number is a fixed limit for each step after the first; 0 is off.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable

FIRST_STEP_S = 3600.0  # auto: the first step compiles every kernel (minutes at 100B+)
FACTOR = 20.0  # auto: later steps may take this many times the longest step so far
FLOOR_S = 600.0  # auto: but never less than this


class StallWatchdog:
    """``beat(step)`` as each step ends; ``close()`` at the end. ``on_stall(message)`` ends the process (tests pass
    their own)."""

    def __init__(self, timeout_s: float | None, out_dir: str, *, start_step: int = 0, poll_s: float = 5.0,
                 on_stall: Callable[[str], None] | None = None):
        self.fixed = timeout_s
        self.out_dir, self.poll_s = out_dir, poll_s
        self.on_stall = on_stall or _end_process
        self.step = start_step  # the last step completed
        self.beats = 0  # steps completed in this process
        self.longest = 0.0  # the longest step after the first
        self._since = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True) if timeout_s != 0 \
            else None  # (0: off)
        if self.thread is not None:
            self.thread.start()

    def limit(self) -> float:
        """Seconds the current step may run."""
        if self.beats == 0:  # the first step compiles every kernel, whatever the setting
            return max(FIRST_STEP_S, float(self.fixed or 0.0))
        if self.fixed is not None:
            return float(self.fixed)
        if self.beats < 2:  # the second step is the first whose pace is known after it
            return FIRST_STEP_S
        return max(FLOOR_S, FACTOR * self.longest)

    def beat(self, step: int) -> None:
        """Step ``step`` has ended."""
        now = time.monotonic()
        if self.beats:  # (the first step's compile does not set the pace)
            self.longest = max(self.longest, now - self._since)
        self.step, self._since, self.beats = step, now, self.beats + 1

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.poll_s, max(0.05, self.limit() / 10))):
            waited, limit = time.monotonic() - self._since, self.limit()
            if waited > limit:
                self._stop.set()
                self.on_stall(self._report(waited, limit))
                return

    def _report(self, waited: float, limit: float) -> str:
        path = os.path.join(self.out_dir, "error.log")
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"--- step {self.step + 1} stalled, {time.strftime('%Y-%m-%d %H:%M:%S')}: every thread's stack\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            path = "(could not be written)"
        return (f"error: train.stall_timeout_s: step {self.step + 1} made no progress for {waited:.0f} s (limit "
                f"{limit:.0f} s), so the run ends rather than hang (a device that failed inside a collective leaves "
                f"the others waiting); the stacks are in {path} (fix: look for an out-of-memory or device error above; "
                f"resume from the last checkpoint with --resume, or raise train.stall_timeout_s, 0 to turn it off)")


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(3)
