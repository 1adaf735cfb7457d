"""Test-only: every process of a multi-process CPU run writes its programs to the persistent compilation cache.

JAX writes cache entries from process 0 only, and on CPU a program's cache key holds the topology of the process
that compiles it (its own devices: ``cache_key._hash_accelerator_config``), so no key of process 0 is ever one of
process 1's: each process i > 0 of a multi-process test compiled every program again in each run a test starts
(process 1 of a tiny sharded run: 8-9 CPU-s where process 0 took 3.7 with the cache). With ``enable()`` a process
other than 0 writes its CPU programs too, under its own keys (no other process writes or reads them): the next run's
process i loads the executables its predecessor compiled instead of compiling them again.
"""


def enable() -> None:
    """Patch JAX's cache write (jax._src.compiler._cache_write) as described above; process 0 writes as before."""
    import warnings

    from jax._src import compilation_cache, compiler, config, distributed

    cache_write = compiler._cache_write

    def write(cache_key, compile_time_secs, module_name, backend, executable):
        if distributed.global_state.process_id == 0 or backend.platform != "cpu":
            return cache_write(cache_key, compile_time_secs, module_name, backend, executable)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:  # as JAX's own write: a failed write warns, the run goes on
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: {e}")
        return None

    compiler._cache_write = write
