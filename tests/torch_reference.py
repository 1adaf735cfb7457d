"""The one harness for the ``transformers`` reference runs (``.venv-torch``: Python 3.11, CPU torch,
transformers; built by ``scripts/setup_torch_ref.sh``): the environment, a clean child environment,
running a reference script, a reference script kept running for a whole test module
(``ReferenceServer``), and the relative error the parity tests compare with."""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
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


class ReferenceServer:
    """``tests/SCRIPT MODE DIR/refs`` in the reference environment, one process for a whole test module.

    Starting torch and building the references takes longer than many of a module's tests, so the
    script starts with the module (``server_fixture``), builds the references while the JAX-only tests
    run, and prints ``ready``; it then answers requests on stdin, one JSON list a line (``["logits",
    TOKENS.npy, OUT.npz, DIR, ...]`` and whatever else the script knows), each with ``done``, so that
    loading our exports back in ``transformers`` needs no second torch start."""

    def __init__(self, d: Path, script: str, mode: str = "serve"):
        self.name = f"{script} {mode}"
        self.dir, self.err = d, open(d / "stderr.txt", "w+")
        self.proc = subprocess.Popen([str(TORCH_VENV / "bin" / "python"), str(ROOT / "tests" / script),
                                      mode, str(d / "refs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=child_env(OMP_NUM_THREADS="2"))
        self.ready = False

    def wait(self, word: str) -> None:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                pytest.fail(f"{self.name} died:\n{self.err.read()[-4000:]}")
            if line.strip() == word:
                return

    def refs(self) -> Path:
        """The references' folder, once they are built."""
        if not self.ready:
            self.wait("ready")
            self.ready = True
        return self.dir / "refs"

    def ask(self, *req: str) -> None:
        """One request, returning when it is answered."""
        self.refs()
        self.proc.stdin.write(json.dumps(list(req)) + "\n")
        self.proc.stdin.flush()
        self.wait("done")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.err.close()


def server_fixture(tmp_path_factory, name: str, script: str, mode: str = "serve") -> Iterator[ReferenceServer | None]:
    """The body of a module-scoped autouse fixture: a ``ReferenceServer`` for the module, or None where the
    reference environment is not built (the JAX-only tests still run; ``served_refs`` skips the rest)."""
    if not (TORCH_VENV / ".ready").exists():
        yield None
        return
    server = ReferenceServer(tmp_path_factory.mktemp(name), script, mode)
    yield server
    server.close()


def served_refs(server: ReferenceServer | None, variants: list[str]) -> Path:
    """The server's references, one folder per expected variant; skips where there is no server."""
    if server is None:
        pytest.skip("no transformers reference environment (scripts/setup_torch_ref.sh)")
    d = server.refs()
    assert sorted(p.name for p in d.iterdir() if p.is_dir()) == sorted(variants)
    return d


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
