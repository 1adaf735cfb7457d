"""One way to run the ``megatrain-jax`` CLI from tests: in-process (``cli_main``: one-line errors,
exit codes) or, where a real process matters (signals, kills, a fresh interpreter), as a subprocess
sharing the persistent XLA compilation cache (``conftest.cli_env``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare.txt")
HOOKS_SCRIPT = os.path.join(REPO, "tests", "train_with_hooks.py")
TIMEOUT_S = 300

# lines JAX / absl / XLA may print on their own (not ours): absl's "W0101 12:00:00.000 ..." format,
# Python warnings and the CPU-fallback notice
NOISE = re.compile(r"^([IWE]\d{4} |WARNING|.*(Warning|warnings\.warn)|An NVIDIA GPU may be present|Platform '\w+' is)")


# the tests compile with LLVM at -O0 on CPU unless MEGATRAIN_TEST_O3=1 (conftest.py says why and what it moves);
# a subprocess that sets its own XLA_FLAGS adds it too
CPU_TEST_XLA_FLAGS = "" if os.environ.get("MEGATRAIN_TEST_O3") == "1" else "--xla_backend_optimization_level=0"


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS of a CPU subprocess with ``devices`` host devices, compiled as the tests' own kernels."""
    return f"--xla_force_host_platform_device_count={devices} {CPU_TEST_XLA_FLAGS}".rstrip()


def cli_env(cache_dir: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: CPU, unbuffered, the shared compilation cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    for k in [k for k in env if k.startswith("MEGATRAIN_DEBUG")]:
        del env[k]
    env.update(extra)
    return env


def cli_command(args: list[str], hooks: dict | None = None) -> list[str]:
    """``python -m megatrain_jax ARGS``, or with ``TrainHooks`` (``{"nan_steps": "3,4",
    "kill_after_step": 7, "kill_in_save": 10}``) through the test-only entry point."""
    if not hooks:
        return [sys.executable, "-m", "megatrain_jax", *args]
    flags = [x for k, v in hooks.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [sys.executable, HOOKS_SCRIPT, *flags, "--", *args]


def sets(*overrides: str) -> list[str]:
    """``--set K=V`` for each override."""
    return [x for s in overrides for x in ("--set", s)]


def listing(folder: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(root, n), folder))
    return sorted(out)


@dataclass
class CliResult:
    args: list[str]
    rc: int
    stdout: str
    stderr: str
    files_before: list[str]
    files_after: list[str]

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines()
                if ln.strip() and (ln.startswith("error:") or not NOISE.match(ln))]

    def __str__(self) -> str:
        return f"args={self.args}\nrc={self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_cli(args: list[str], cwd: str = REPO, env: dict | None = None, hooks: dict | None = None,
            timeout: float = TIMEOUT_S) -> CliResult:
    """The CLI as a subprocess (``env``: ``cli_env(...)``, e.g. the ``cli_env`` fixture)."""
    before = listing(cwd) if cwd != REPO else []
    p = subprocess.run(cli_command(args, hooks), cwd=cwd, env=env or cli_env(), capture_output=True, text=True,
                       timeout=timeout)
    return CliResult(args, p.returncode, p.stdout, p.stderr, before, listing(cwd) if cwd != REPO else [])


def run_in_process(args: list[str], capsys, watch: str | None = None) -> CliResult:
    """``megatrain_jax.cli.main(args)`` in this process; ``watch``: a folder whose files are listed
    before and after (nothing may appear there on an error)."""
    from megatrain_jax.cli import main

    capsys.readouterr()
    before = listing(watch) if watch else []
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse: --help, usage errors
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return CliResult(list(args), rc, out.out, out.err, before, listing(watch) if watch else [])


def check_user_error(res: CliResult, field: str, watch: str | None = None) -> str:
    """Exit 2, exactly one line ``error: FIELD: problem (fix: ...)``, nothing on stdout, no file
    written (``watch``: no ``run`` out_dir there, and its listing unchanged). Returns the line."""
    assert res.rc == 2, str(res)
    lines = res.error_lines()
    assert len(lines) == 1, f"expected one error line:\n{res}"
    line = lines[0]
    assert line.startswith(f"error: {field}: "), f"does not name {field!r}:\n{res}"
    assert "(fix: " in line and line.rstrip().endswith(")"), str(res)
    assert "Traceback" not in res.stderr, str(res)
    assert res.stdout.strip() == "", f"nothing but the error expected:\n{res}"
    if watch is not None:
        assert not os.path.exists(os.path.join(watch, "run")), str(res)
        assert res.files_after == res.files_before, f"{res.files_before} -> {res.files_after}\n{res}"
    return line


def tree_snapshot(root) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with (size, or -1 for a folder; mtime in ns): equal snapshots mean nothing there
    was written, created or removed (the writers' tests compare them around a refused command)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size if name in filenames else -1, st.st_mtime_ns)
    return out
