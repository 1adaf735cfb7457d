"""Shared test set-up: CPU only, deterministic, quiet."""
import faulthandler
import os
import signal
import sys
import tempfile

# Python caches compiled bytecode here even where the machine says not to (PYTHONDONTWRITEBYTECODE=1 on this
# project's machines): without the cache every subprocess the tests start (CLI runs, the data-parallel
# processes, ~60 a run) compiles the source of jax, numpy, flax and optax again, 3.4 s of CPU each; a tiny
# train run took 6.5 s and takes 3.2 s with it (a 2-core AMD EPYC). Set before jax is imported,
# so this worker caches its own imports too; subprocesses inherit the environment.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/cli_runner.py and helpers
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# The tests compile with LLVM at -O0 on CPU (cli_runner.CPU_TEST_XLA_FLAGS; subprocesses inherit it):
# MEGATRAIN_TEST_O3=1 compiles as a user's run does. Half of a clean-clone run is XLA:CPU compiling hundreds of
# tiny kernels (the same suite took 286 s with a warm compilation cache, ~600 s cold), and -O0 cuts that: 484 s
# cold, 879 passed (a 2-core AMD EPYC). Every comparison is between two programs compiled alike;
# -O0 moves float rounding (no multiply-add contracted) and the tightest margins stay wide: the AdamW named
# optimizer 3.1e-6 of its 1e-5 bound (2.2e-6 at -O3), the GPT-2 nnx example 2.6e-6 of 1e-5 (2.7e-6), a LoRA
# adapter entry 6e-7 of 1e-5 (3.4e-6). (-O1 moved the GPT-2 nnx example to 1.46e-5: not taken.)
from cli_runner import CPU_TEST_XLA_FLAGS  # noqa: E402

if CPU_TEST_XLA_FLAGS and os.environ["JAX_PLATFORMS"] == "cpu" and CPU_TEST_XLA_FLAGS not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + CPU_TEST_XLA_FLAGS

# one persistent XLA compilation cache, kept between runs, for the tests and every process they start
# (set in the environment before JAX is imported, so subprocesses inherit it): the same kernels compiled by
# another jit object, worker or process (a resumed trainer, the next test's engine, a CLI run) load instead
# of compiling again
_XLA_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla_inproc")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# the host kernels' OpenMP threads (numba's parallel kernels: host AdamW, the store's casts) sleep as soon as a
# kernel ends instead of spinning for the next one: on CI's two cores three workers and their subprocesses share
# them, and a spinning thread takes a core another worker is computing on. Waiting only: no result changes.
# test_engine + test_stream_io, -n 3 --dist load, warm cache: 92-104 CPU-s in four runs, 100-107 spinning in three
# (a 2-core Intel Xeon)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

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


# modules whose tests compile and run the streamed engine, a transformers reference or real processes:
# `pytest -m "not slow"` is the quick loop (config, CLI errors, plan, data, optimizer kernels); CI runs all
SLOW_MODULES = {"test_seq_tiling", "test_stream", "test_train", "test_engine", "test_named_optimizers",
                "test_data_parallel", "test_moe", "test_device_optax", "test_lora", "test_grad_hold",
                "test_stream_io", "test_boundary_every", "test_families", "test_hf", "test_trainer",
                "test_templates", "test_checkpoint", "test_device_update", "test_compact_adamw", "test_finetune_hf",
                "test_chat", "test_attention", "test_long_context", "test_constraints", "test_lora_trainer",
                "test_lora_export", "test_lora_dp", "test_sharded_state"}
# every module that takes more than a few seconds, costliest first: the order the workers get them in (the rest
# follow, in xdist's order). Measured as each module's CPU seconds alone with an empty compilation cache
# (`/usr/bin/time pytest tests/<module>.py`, a 2-core machine): seq_tiling 107, engine 106,
# stream_io 104, train 93, device_optax 93, data_parallel 89, plan_properties 88, hf 82, stream 78, moe 78,
# named_optimizers 75, long_context 74, families 56, boundary_every 50, device_update 41, plan_search 39, trainer 35,
# cli_properties 33, compact_adamw 28, attention 27, chat 25, plan 24, templates 24, working_set 21, muon 19,
# device_adamw 18, cli 16, plan_fixes 14, checkpoint 12, finetune_hf 12, optim 11; the LoRA modules and grad_hold
# where a clean-clone run's durations put them (test_lora: its transformers reference, the costliest); since the
# device-side optax updates moved into test_named_optimizers it takes test_device_optax's place
COST_ORDER = ["test_lora", "test_seq_tiling", "test_engine", "test_stream_io", "test_train", "test_named_optimizers",
              "test_data_parallel", "test_plan_properties", "test_sharded_state", "test_hf", "test_stream", "test_moe",
              "test_device_optax", "test_long_context", "test_lora_dp", "test_lora_trainer", "test_families",
              "test_boundary_every", "test_grad_hold", "test_device_update", "test_plan_search", "test_trainer",
              "test_cli_properties", "test_lora_export", "test_compact_adamw", "test_attention", "test_chat",
              "test_plan", "test_templates", "test_working_set", "test_muon", "test_device_adamw", "test_cli",
              "test_plan_fixes", "test_checkpoint", "test_finetune_hf", "test_optim"]
# (the next five: the slowest of the quick subset, 5-10 s a case, which kept `scripts/test.sh --quick` over 2 minutes)
SLOW_TESTS = {"test_happy_path_trains_and_logs", "test_relative_out_dir_saves_resumes_and_exports",
              "test_module_entry_point_gives_one_line_errors", "test_console_script_help",
              "test_commands_interleaved_with_damage_lose_nothing_silently",
              "test_b_a_single_change_that_fits_is_found_or_named", "test_a_every_fix_a_refusal_names_fits",
              "test_streamed_engine_equals_whole_model_gradient",
              "test_a_hung_step_ends_the_run_with_one_line_and_keeps_the_checkpoint"}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n 3 --dist loadfile`` (scripts/test.sh): the costliest module first (COST_ORDER, then the
    rest in xdist's order), each handed out only when a worker is about to run out, so that neither
    worker holds a long module queued while the other idles at the end."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    rank = {m: i for i, m in enumerate(COST_ORDER)}

    class CostliestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            unit = min(self.workqueue, key=lambda s: rank.get(os.path.splitext(os.path.basename(s))[0], len(rank)))
            self.workqueue.move_to_end(unit, last=False)  # the next unit handed out (min keeps xdist's order on ties)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            # xdist hands a worker its next module while it still has 2 tests pending (its own heuristic);
            # a worker always holds back its last test until it knows what follows, so 1 is the latest point
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return CostliestFirst(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cli_env() -> dict:
    """The environment of every CLI subprocess (``tests/cli_runner.py``): CPU, and the tests' persistent
    XLA compilation cache, so a run compiles a shape once."""
    from cli_runner import cli_env as make_env

    return make_env(os.environ["JAX_COMPILATION_CACHE_DIR"])


# ``MEGATRAIN_TEST_CPU_LOG=FILE``: each test's CPU seconds (this worker's and its finished subprocesses'), one JSON
# line per test appended to FILE, to find where the suite's CPU goes (on CI's two cores the suite is CPU-bound,
# so a test's wall time under xdist says little). Diagnosis only.
_CPU_LOG = os.environ.get("MEGATRAIN_TEST_CPU_LOG")


if _CPU_LOG:
    import json as _json
    import resource as _resource

    def _cpu_s() -> float:
        a, b = _resource.getrusage(_resource.RUSAGE_SELF), _resource.getrusage(_resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0 = _cpu_s()
        yield
        with open(_CPU_LOG, "a") as f:
            f.write(_json.dumps({"test": item.nodeid, "cpu_s": _cpu_s() - t0}) + "\n")
