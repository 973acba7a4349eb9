"""engine/openmp.py: a thread that is done with torch gives its OpenMP workers back, and a later
parallel region on it starts new ones."""

import subprocess
import sys
from pathlib import Path

# In a fresh interpreter: the test process has other threads coming and going.
SCRIPT = """
import os
import torch
from engine.openmp import release_thread_pool

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
alone = threads()
a = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 1e5
first = a @ a
with_pool = threads()
released = release_thread_pool()
after = threads()
again = a @ a
print(alone, with_pool, released, after, threads(), torch.equal(first, again))
"""


def test_a_released_pool_stops_its_workers_and_a_later_kernel_starts_new_ones():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            cwd=Path(__file__).parents[1], timeout=120)
    assert result.returncode == 0, result.stderr
    alone, with_pool, released, after, rebuilt, equal = result.stdout.split()
    assert int(with_pool) == int(alone) + 1  # the main thread's team: one worker beside it
    assert released == "True"
    assert int(after) == int(alone)
    assert int(rebuilt) == int(with_pool) and equal == "True"


IDLE_SCRIPT = """
import asyncio, os, time
from engine import AsyncEngine, SamplingParams, create_engine
from engine.config import EngineConfig
from engine.openmp import release_thread_pool

def threads():
    return len(os.listdir("/proc/self/task"))

llm = create_engine(EngineConfig())  # the bundled model
release_thread_pool()  # loading left this thread a team
engine = AsyncEngine(llm)
alone = threads()

async def answer():
    async for _ in engine.generate(list(range(100, 300)), SamplingParams(max_tokens=4)):
        pass

asyncio.run(answer())  # the engine thread's team: a worker beside it while it steps
deadline = time.monotonic() + 10
while threads() > alone and time.monotonic() < deadline:
    time.sleep(0.01)
print(alone, threads())
engine.shutdown()
"""


def test_an_idle_engine_thread_gives_its_workers_back():
    """Spinning workers of an idle engine slow the API threads that run between its requests
    (retrieval, the receipt commit): with no request left, the engine thread releases them."""
    result = subprocess.run([sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True,
                            cwd=Path(__file__).parents[1], timeout=300)
    assert result.returncode == 0, result.stderr
    alone, idle = result.stdout.split()
    assert int(idle) == int(alone)
