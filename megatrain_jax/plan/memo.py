"""What the plans of one ``make_plan`` call share. Its fetch and update alternatives, its state modes and its
fix's replans (another host limit, fewer tokens, a setting given back) search the same placements of the same
shapes again, and each search costs thousands of candidates: their GPU phases, host sums and predicted steps are
kept here, each table keyed on everything its results are computed from. One memo lives as long as the call's
plans: nothing is kept between calls (another config, or a constant a test patched, starts afresh).
"""
from __future__ import annotations

from typing import Any, Callable


class PlanMemo:
    """Values made once per key for the plans of one ``make_plan`` call."""

    def __init__(self) -> None:
        self._kept: dict[tuple, Any] = {}

    def once(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The value kept for ``key``, made by ``make()`` the first time it is asked for."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def table(self, *key: Any) -> dict:
        """The table kept for ``key`` (empty the first time): results keyed within it by what varies."""
        return self.once(key, dict)
