"""The one harness for the ``transformers`` reference runs (``.venv-torch``: Python 3.11, CPU torch,
transformers; built by ``scripts/setup_torch_ref.sh``): the environment, a clean child environment,
running a reference script, and the relative error the parity tests compare with."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_VENV = ROOT / ".venv-torch"


def torch_python() -> str:
    """The reference interpreter, building its environment if it is missing; skips the test where this
    machine has no Python 3.11 or no CPU torch wheel (the set-up script's exit codes 3 and 4)."""
    if not (TORCH_VENV / ".ready").exists():  # written by the set-up script once everything is installed
        r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_torch_ref.sh")], capture_output=True, text=True,
                           timeout=1200, stdin=subprocess.DEVNULL)
        if r.returncode in (3, 4):
            pytest.skip(f"no transformers reference environment: {r.stderr.strip()}")
        assert r.returncode == 0, f"scripts/setup_torch_ref.sh failed:\n{r.stdout}\n{r.stderr}"
    return str(TORCH_VENV / "bin" / "python")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without our Python/JAX settings, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX", "XLA", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def run_reference(torch_py: str, *args: str, script: str = "hf_reference.py", timeout: int = 600) -> None:
    """``tests/SCRIPT ARGS...`` in the reference environment; fails the test with its output if it fails."""
    r = subprocess.run([torch_py, str(ROOT / "tests" / script), *args], capture_output=True, text=True,
                       env=child_env(OMP_NUM_THREADS="2"), timeout=timeout, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{script} {args[0] if args else ''} failed:\n{r.stdout}\n{r.stderr[-4000:]}"


def make_references(torch_py: str, out: Path, command: str, expected: list[str]) -> Path:
    """``hf_reference.py COMMAND OUT``: one folder per expected variant."""
    run_reference(torch_py, command, str(out))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(expected)
    return out


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
