"""A per-layer timeline of a streamed step: host->GPU, compute, GPU->host and optimizer lanes.

Device work is asynchronous, so the engine reports each operation's result array at dispatch
(``watch``) and one watcher thread per lane waits for it to become ready. A lane's operations
complete in issue order (one stream each), so an operation's bar runs from
``max(issue, previous completion in the lane)`` to its completion: exact for the end, an upper
bound on the start. The host optimizer reports real intervals (``interval``).

Exposed time is read off the compute lane: every gap in it is time the GPU waited, and the gap is
charged to the stage that ended last before the compute resumed (a weight transfer, a host update
that the dispatching thread waited for, or the host's own dispatch).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

LANES = ("h2d", "compute", "d2h", "optimizer")


class Tracer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        for lane in ("h2d", "compute", "d2h"):
            q: queue.Queue = queue.Queue()
            t = threading.Thread(target=self._watch_loop, args=(lane, q), daemon=True)
            t.start()
            self._queues[lane], self._threads = q, self._threads + [t]
        self._last_done: dict[str, float] = {}

    def watch(self, lane: str, label: str, arr: Any) -> None:
        self._queues[lane].put((label, arr, time.perf_counter()))

    def interval(self, lane: str, label: str, t_start: float, t_end: float) -> None:
        with self._lock:
            self.events.append({"lane": lane, "label": label, "start": t_start - self.t0, "end": t_end - self.t0,
                                "issue": t_start - self.t0})

    def _watch_loop(self, lane: str, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            label, arr, t_issue = item
            start = max(t_issue, self._last_done.get(lane, t_issue))
            try:
                arr.block_until_ready()
            except Exception:  # noqa: BLE001 - consumed (donated, deleted) before this thread reached it, so complete
                # by then: its bar is kept with no length ("observed": False) and charged no wait (exposed_times)
                with self._lock:
                    self.events.append({"lane": lane, "label": label, "start": start - self.t0, "end": start - self.t0,
                                        "issue": t_issue - self.t0, "observed": False})
                continue
            done = time.perf_counter()
            self._last_done[lane] = done
            with self._lock:
                self.events.append({"lane": lane, "label": label, "start": start - self.t0, "end": done - self.t0,
                                    "issue": t_issue - self.t0})

    def close(self) -> list[dict[str, Any]]:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        return sorted(self.events, key=lambda e: e["start"])


def exposed_times(events: list[dict[str, Any]], step_start: float, step_end: float) -> dict[str, float]:
    """Seconds of the step during which the compute lane idled, charged to the stage that held it up."""
    seen = [e for e in events if e.get("observed", True)]  # an unobserved bar has no length to charge
    comp = sorted((e for e in seen if e["lane"] == "compute"), key=lambda e: e["end"])
    others = [e for e in seen if e["lane"] in ("h2d", "optimizer", "d2h")]
    out = {"h2d": 0.0, "optimizer": 0.0, "d2h": 0.0, "dispatch": 0.0, "compute_busy": 0.0}
    prev_end = step_start
    for e in comp:
        start = max(e["start"], prev_end)
        out["compute_busy"] += max(e["end"] - start, 0.0)
        gap = start - prev_end
        if gap > 1e-4:
            # the latest-finishing other stage that ended inside the gap is what compute waited for
            inside = [o for o in others if prev_end <= o["end"] <= start + 1e-4]
            if inside:
                out[max(inside, key=lambda o: o["end"])["lane"]] += gap
            else:
                out["dispatch"] += gap
        prev_end = max(prev_end, e["end"])
    out["tail_after_compute"] = max(step_end - prev_end, 0.0)
    return out


def plot_timeline(events: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG: one row per lane, a bar per operation, labelled by layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"h2d": "#4c78a8", "compute": "#54a24b", "d2h": "#e45756", "optimizer": "#f58518"}
    fig, ax = plt.subplots(figsize=(16, 3.6))
    for row, lane in enumerate(reversed(LANES)):
        lane_events = [e for e in events if e["lane"] == lane]
        ax.broken_barh([(e["start"], max(e["end"] - e["start"], 1e-5)) for e in lane_events], (row - 0.4, 0.8),
                       facecolors=colors[lane], edgecolors="white", linewidth=0.3)
        for e in lane_events:
            width = e["end"] - e["start"]
            if width > 0.012 * (max(x["end"] for x in events) - min(x["start"] for x in events)):
                ax.text(e["start"] + width / 2, row, e["label"].replace("block_", "b"), ha="center", va="center",
                        fontsize=5, color="white")
    ax.set_yticks(range(len(LANES)))
    ax.set_yticklabels(list(reversed(["host->GPU", "GPU compute", "GPU->host", "host optimizer"])))
    ax.set_xlabel("seconds")
    ax.set_title(title or "streamed step timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
