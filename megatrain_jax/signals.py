"""Ctrl-C and SIGTERM in a training run (``train.py``): the first finishes the step and saves a
checkpoint; a second aborts (a save in flight is abandoned, its writer waited for) and ends in one
line naming the newest complete checkpoint (``abort_line``); later ones are ignored until the
abort has cleaned up. Also the test hook that interrupts the main thread mid-save."""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable


class StopSignals:
    """SIGINT / SIGTERM: remember it and let the loop finish the step; a second one aborts (raises
    ``KeyboardInterrupt``); any later one is ignored while the abort cleans up (``restore`` ends it)."""

    def __init__(self):
        self.received: str | None = None
        self.aborting: str | None = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.aborting is not None:
            return  # the abort is cleaning up (a save in flight is being abandoned): it ends in moments
        if self.received is not None:
            self.aborting = name
            raise KeyboardInterrupt(f"second {name}")
        self.received = name
        print(f"\n{name}: finishing the current step, then saving a checkpoint (send it again to abort)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()


def abort_line(why: str, step_done: int, abandoned_step: int | None, checkpoints: list | None, out_dir: str,
               main: bool = True) -> str:
    """The one line after an abort: what became of the save in flight, and the newest complete
    checkpoint of ``checkpoints`` (``checkpoint.list_checkpoints``; None where this process writes none)."""
    line = f"{why}: aborted after step {step_done}"
    if abandoned_step is not None:
        line += f"; the save of step {abandoned_step} was abandoned (nothing of it is kept)"
    if checkpoints is None:
        return line + ("" if main else "; process 0 keeps the checkpoints")
    if not checkpoints:
        return line + "; no complete checkpoint exists: start the run again (without --resume)"
    newest = checkpoints[-1]
    return (line + f"; the newest complete checkpoint is {newest.path} (step {newest.step}), intact: continue "
            f"with `megatrain-jax train ... --resume` (train.out_dir={out_dir})")


def interrupt_main_until(done: Callable[[], bool], timeout: float = 60.0) -> None:
    """Test hook (``train.TrainHooks.sigint_in_save``): a Ctrl-C reaches the main thread now, and the
    calling thread (a checkpoint writer) stays busy, as a large save would, until ``done()``."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
