"""Sizes as the plan writes them for people: ``size_text``.

Its own module because two layers print it: the table (``report``, which plans through ``build``) and the
disk refusal (``refusal``, which ``build`` asks for the verdict). Kept in ``report`` it made ``report`` ->
``build`` -> ``refusal`` -> ``report`` a cycle; here both read it from below.
"""
from __future__ import annotations

from megatrain_jax.plan.sizes import GB


def size_text(nbytes: float) -> str:
    """A size that means something at any scale: GB from 1 GB up, MB below (``plan`` and its disk refusal)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB else f"{nbytes / 1e6:.1f} MB"
