"""A server's tokenizer workers in the benchmark's own process: what /metrics does not say.

/metrics counts the workers' processor-cache hits and misses but has no preprocessing
time, and nothing counts the bytes a worker sends to the scheduler. `WorkerProbe` builds
the workers an `iris serve` with the same flags would start (`--tokenizer-workers`,
`--disable-mm-processor-cache`, the arena size: the launcher's own `worker_config`),
routes each request as the server does (`server.image_router`, fed the same requests), and runs
the same `TokenizerWorker` code (chat template, data: URL decoding, xxh3_128 keys,
processor cache, HF image processor, arena) on the same messages. Per request:

- `seconds`: wall time of `TokenizerWorker.handle` (from the OpenAI messages to the
  `EngineRequest`; not the ZMQ transfer of the request from the server);
- `wire_bytes`: the `EngineRequest` encoded with the tokenizer→scheduler codec, i.e. the
  bytes that cross ZMQ to the scheduler;
- `pixel_bytes`: the pixel_values the request points at in shared memory (what would
  cross if pixels were sent).

After each request the probe releases its pins, as the scheduler does once the images
are encoded, so each worker's processor cache holds what a server's would hold. Run it
when no server is being timed: it competes for the same cores.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iris_serve.ipc.messages import TOKENIZER_TO_SCHEDULER, EngineRequest, ReleaseImages, Sampling
from iris_serve.ipc.messages import TokenizeRequest as _TokenizeRequest
from iris_serve.ipc.shm_names import instance_prefix, new_instance_id, sweep
from iris_serve.server.args import parse_serve_args
from iris_serve.server.image_router import ImageRouter
from iris_serve.server.launcher import worker_config
from iris_serve.tokenizer_worker.worker import TokenizerWorker


@dataclass(frozen=True)
class ProbeResult:
    worker: int  # which worker the server's routing picks
    seconds: float
    wire_bytes: int
    pixel_bytes: int
    images: int
    processed: int  # decoded and run through the HF processor (misses, or all when off)
    cache_hits: int
    cache_misses: int


class WorkerProbe:
    """The tokenizer workers of `iris serve MODEL_DIR *serve_flags`, in process."""

    def __init__(self, model_dir: str | Path, serve_flags: Sequence[str] = ()) -> None:
        args = parse_serve_args([str(model_dir), *serve_flags])
        self._run_dir = tempfile.TemporaryDirectory(prefix="iris-probe-")
        self._instance = new_instance_id()
        self.workers: list[TokenizerWorker] = []
        try:
            for worker_id in range(args.tokenizer_workers):
                config = worker_config(
                    args, worker_id, Path(model_dir), self._instance, Path(self._run_dir.name)
                )
                self.workers.append(TokenizerWorker.open(config))
        except BaseException:
            self.close()
            raise
        self._router = ImageRouter(len(self.workers))  # the server's, fed the same requests
        self._count = 0

    def __enter__(self) -> WorkerProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []
        sweep(instance_prefix(self._instance))
        self._run_dir.cleanup()

    def run(
        self, messages: Sequence[dict[str, Any]], *, max_pixels: int | None = None
    ) -> ProbeResult:
        """One chat request (with `mm_processor_kwargs.max_pixels`, if given) through the
        worker the server would pick (requests replayed in the server's order, one at a
        time: no load); its pins are released afterwards."""
        index = self._router.pick(list(messages), [0] * len(self.workers))
        worker = self.workers[index]
        hits, misses = worker.cache.hits, worker.cache.misses
        processed = worker.images_processed
        self._count += 1
        request = _TokenizeRequest(
            f"probe-{self._count}", Sampling(), messages=list(messages), max_pixels=max_pixels
        )
        started = time.perf_counter()
        out = worker.handle(request)
        seconds = time.perf_counter() - started
        if not isinstance(out, EngineRequest):
            raise RuntimeError(f"the worker refused the request: {out}")
        wire = len(TOKENIZER_TO_SCHEDULER.encode(out))
        pointers = [image.pixels for image in out.images if image.pixels is not None]
        worker.release(ReleaseImages([pointer.handle for pointer in pointers]))
        return ProbeResult(
            worker=index,
            seconds=seconds,
            wire_bytes=wire,
            pixel_bytes=sum(pointer.nbytes for pointer in pointers),
            images=len(out.images),
            processed=worker.images_processed - processed,
            cache_hits=worker.cache.hits - hits,
            cache_misses=worker.cache.misses - misses,
        )
