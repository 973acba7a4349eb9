"""Moving a request's KV blocks from the prefill worker's paged cache into the decode worker's.

The two workers form a two-rank torch.distributed group (rank 0 prefill, rank 1 decode): gloo
on CPU (it runs over TCP, so the ranks may sit on different hosts), NCCL when both caches are on
distinct GPUs. A hand-off is one message: the request's blocks of every layer, gathered into one
``[layers, blocks, block_size, 2, kv_heads, head_dim]`` tensor (a block is contiguous in each
layer's cache, see engine/attention.py), received into the same shape and scattered into the
blocks the decode worker allocated.

Each side runs its transfers on a thread of its own, one at a time, in the order the decode
worker asked for them: the sender overlaps the prefill worker's next steps, the receiver the
decode worker's. gloo's send/recv complete only inside ``wait()`` (``is_completed()`` stays false
until then), so a blocking call on a thread is also the only way not to poll. Both sides also
tag each message with the transfer's number: on gloo a mismatch then waits instead of writing one
request's KV into another's blocks (NCCL ignores tags; the shared order is what matches there).
A transfer thread reports when it starts and ends a job (`on_busy`): the engine's heartbeat
check (engine/disaggregated.py) then also catches a transfer that never completes.
"""

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.timeline import now

PREFILL_RANK, DECODE_RANK = 0, 1


def transfer_backend(prefill_device: str, decode_device: str) -> str:
    """NCCL between two distinct GPUs, gloo otherwise (CPU, or both roles on one GPU, which
    NCCL refuses; gloo then goes through host memory)."""
    a, b = torch.device(prefill_device), torch.device(decode_device)
    if a.type == b.type == "cuda" and a != b:
        return "nccl"
    return "gloo"


def join_transfer_group(rank: int, addr: str, port: int, backend: str, timeout_s: float) -> None:
    """Rendezvous at ``addr:port`` (rank 0 hosts the store) and form the two-rank group."""
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout_s))


def gather_blocks(kv_cache: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The blocks ``block_ids`` of every layer, as one contiguous tensor (one copy)."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache[0].device)
    first = kv_cache[0]
    out = torch.empty((len(kv_cache), len(block_ids), *first.shape[1:]), dtype=first.dtype,
                      device=first.device)
    for layer, part in zip(kv_cache, out, strict=True):
        torch.index_select(layer, 0, index, out=part)
    return out


def scatter_blocks(kv_cache: list[torch.Tensor], block_ids: list[int],
                   blocks: torch.Tensor) -> None:
    """Write a tensor from :func:`gather_blocks` into the blocks ``block_ids``."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache[0].device)
    for layer, part in zip(kv_cache, blocks, strict=True):
        layer.index_copy_(0, index, part.to(layer.device, non_blocking=True))


class _TransferThread:
    """Runs jobs one at a time, in submission order, on a daemon thread."""

    def __init__(self, name: str, on_error: Callable[[str, BaseException], None],
                 on_busy: Callable[[bool], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_error = on_error
        self._on_busy = on_busy
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            request_id, job = self._jobs.get()
            self._on_busy(True)
            try:
                job()
            except BaseException as error:  # the group is broken: the worker reports and exits
                self._on_error(request_id, error)
                return
            self._on_busy(False)


class KVSender(_TransferThread):
    """Prefill side: sends requests' blocks to the decode rank."""

    def __init__(self, kv_cache: list[torch.Tensor], backend: str,
                 on_sent: Callable[[str], None],
                 on_error: Callable[[str, BaseException], None],
                 on_busy: Callable[[bool], None]):
        super().__init__("inherent-kv-sender", on_error, on_busy)
        self.kv_cache = kv_cache
        self.on_host = backend == "gloo"
        self.on_sent = on_sent

    def submit(self, request_id: str, block_ids: list[int], tag: int) -> None:
        def send() -> None:
            blocks = gather_blocks(self.kv_cache, block_ids)
            if self.on_host:
                blocks = blocks.cpu()
            dist.send(blocks, DECODE_RANK, tag=tag)
            self.on_sent(request_id)

        self._jobs.put((request_id, send))


class KVReceiver(_TransferThread):
    """Decode side: receives a request's blocks and writes them into the blocks allocated for
    it. Safe beside the decode steps: nothing else reads or writes those blocks until the
    request joins the running batch, after `on_received`."""

    def __init__(self, kv_cache: list[torch.Tensor], backend: str,
                 on_received: Callable[[str, float, int], None],
                 on_error: Callable[[str, BaseException], None],
                 on_busy: Callable[[bool], None]):
        super().__init__("inherent-kv-receiver", on_error, on_busy)
        self.kv_cache = kv_cache
        self.device = torch.device("cpu") if backend == "gloo" else kv_cache[0].device
        self.on_received = on_received

    def submit(self, request_id: str, block_ids: list[int], tag: int) -> None:
        def receive() -> None:
            cache = self.kv_cache
            blocks = torch.empty((len(cache), len(block_ids), *cache[0].shape[1:]),
                                 dtype=cache[0].dtype, device=self.device)
            dist.recv(blocks, PREFILL_RANK, tag=tag)
            scatter_blocks(cache, block_ids, blocks)
            self.on_received(request_id, now(), blocks.numel() * blocks.element_size())

        self._jobs.put((request_id, receive))
