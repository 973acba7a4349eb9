"""The process's OpenMP threads: torch's CPU kernels and ours run their parallel regions on them.

The OpenMP runtime (GNU libgomp in torch's wheels) gives every thread that starts a parallel
region a pool of worker threads of its own, kept until that thread ends. Once the runtime
manages more threads than the process may use cores, libgomp cuts every idle worker's
busy-wait from about 300,000 spins (a few ms) to 100. The engine's workers then fall asleep in
the gaps between its kernels, each kernel wakes them through the kernel's futex, and the engine
thread waits for them at the kernel's end. A server that loads the model on its main thread
(which leaves that thread a pool) and steps it on the engine thread is in that state on
2 cores: 16 streams on AsyncEngine gave 160-200 output tok/s with the main thread's pool kept,
237-296 with it released (Zen 4 kind, 70 s runs).

So a thread that is done with torch releases its pool: the next parallel region it starts (if
any) builds a new one, at the cost of creating its threads.
"""

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads stop; the runtime stays initialized


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (this process's, found in its memory map), or None."""
    import torch  # noqa: F401  (loads the runtime)

    with open("/proc/self/maps") as maps:
        paths = sorted({fields[-1] for line in maps if len(fields := line.split()) == 6})
    for path in paths:
        if path.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp", "libomp")):
            runtime = ctypes.CDLL(path)  # the loaded library's own handle, not a second copy
            if hasattr(runtime, "omp_pause_resource_all"):
                return runtime
    return None


def release_thread_pool() -> bool:
    """Stop the calling thread's OpenMP workers (OpenMP 5's omp_pause_resource_all, soft).
    False where no such runtime is loaded (another platform, another build of torch)."""
    try:
        runtime = _runtime()
    except OSError:  # no /proc: not Linux
        return False
    if runtime is None:
        return False
    if runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) != 0:
        log.debug("the OpenMP runtime refused to release this thread's pool")
        return False
    return True
