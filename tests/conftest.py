"""Shared test set-up: CPU only, deterministic, quiet."""
import faulthandler
import os
import signal
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import pytest  # noqa: E402

# a hung run can be asked where every thread is: `kill -USR2 <worker pid>` writes all stacks to
# $TMPDIR/pytest_stacks_<pid>.txt (diagnosis only; nothing else changes)
_STACKS = open(os.path.join(tempfile.gettempdir(), f"pytest_stacks_{os.getpid()}.txt"), "w")
faulthandler.register(signal.SIGUSR2, file=_STACKS, all_threads=True)


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
