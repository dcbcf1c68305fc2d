"""The scheduler process: drives the engine from its sockets (`docs/design.md`, "The
engine's step" and "Life of an image").

    receive → admit (pixels stay in shared memory) → step → send tokens → release pins

An `EngineRequest` becomes the engine's prompt descriptor plus zero-copy views of the
owning worker's arena, whose pins the engine holds from then on (`PixelStore`). What
`Engine.pop_released_pins` hands back after every step or abort goes to the owning
worker as `ReleaseImages`. What goes to the server (tokens, per-request errors, stats)
is queued on a `PushThread`, so a step never waits on a slow server and nothing is
dropped. A step that raises fails only its requests, each with a 500 `RequestError`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import torch

from ..common.logs import configure_logging
from ..common.process_heap import freeze_startup_heap
from ..ipc.local import PromptInput
from ..ipc.messages import (
    SCHEDULER_TO_TOKENIZER,
    TO_SERVER,
    TOKENIZER_TO_SCHEDULER,
    AbortEngineRequest,
    CoreReady,
    EngineRequest,
    EngineStats,
    MediaWork,
    ProcessFailed,
    ReadySink,
    ReleaseImages,
    RequestError,
    RequestOutput,
    Sampling,
    SchedulerReady,
    ShmHandle,
    ShmPointer,
    TokenBatch,
    TokenizerToScheduler,
    ToServer,
    context_length_error,
)
from ..ipc.push_thread import PushThread
from ..ipc.shm_arena import ShmReader
from ..ipc.sockets import PullSocket, PushSocket, ipc_address, scheduler_socket
from .entry import SchedulerProcessConfig
from .kv.event_publisher import ZmqEventPublisher
from .kv.pinned_host import cuda_host_registrar
from .ranks import StepBroadcaster, join_group
from .step.engine import Engine
from .step.faults import STEP_ERROR_STATUS, STEP_ERROR_TYPE

logger = logging.getLogger("iris.scheduler")
IDLE_POLL_SECONDS = 0.1
STATS_INTERVAL_SECONDS = 0.2


class SchedulerLoop:
    def __init__(self, engine: Engine, run_dir: Path, num_workers: int, replica: int = 0) -> None:
        self.engine = engine
        self.replica = replica
        self.inbox = PullSocket(
            TOKENIZER_TO_SCHEDULER, ipc_address(run_dir, scheduler_socket(replica))
        )
        self.to_server = PushThread(
            TO_SERVER, ipc_address(run_dir, "server"), name="iris-to-server"
        )
        self.to_workers = [
            PushSocket(SCHEDULER_TO_TOKENIZER, ipc_address(run_dir, f"release-{i}"))
            for i in range(num_workers)
        ]
        self.reader = ShmReader(on_map=cuda_host_registrar(engine.device))
        events = engine.config.kv_events
        self.kv_events = None if events is None else ZmqEventPublisher(events, replica)
        self.stopping = False
        self._last_stats: EngineStats | None = None
        self._encoder_seconds: list[float] = []
        self._last_stats_time = 0.0

    def run(self) -> None:
        parent = os.getppid()
        while not self.stopping and os.getppid() == parent:
            busy = self.engine.has_unfinished_requests()
            message = self.inbox.recv(0 if busy else IDLE_POLL_SECONDS)
            while message is not None:
                self._handle(message)
                message = self.inbox.recv(0)
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self._release_pins()  # pixels the step no longer needs, finished requests'
            # Stats before outputs on the one socket: when a client has its answer,
            # /metrics already shows the step that produced it.
            self._send_stats()
            self._send_outputs(outputs)
            self._send_failures()
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.take_kv_events())

    def close(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self.engine.close()
        self._release_pins()
        self.inbox.close()
        self.to_server.close()
        for socket in self.to_workers:
            socket.close()
        self.reader.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # -- messages in ----------------------------------------------------------------------

    def _handle(self, message: TokenizerToScheduler) -> None:
        if isinstance(message, MediaWork):  # between steps: the next one plans with it
            self.engine.media_work(message.worker_id, message.busy)
            if message.busy:
                self._send_to_worker(message.worker_id, CoreReady(message.seq))
            return
        if isinstance(message, AbortEngineRequest):
            self.engine.abort(message.request_id)
            self._release_pins()
            return
        pins = [image.pixels for image in message.images]
        try:
            prompt, sampling = self._admission(message)
            self.engine.add_request(message.request_id, prompt, sampling, pins, message.reports)
        except ValueError as error:  # the engine took nothing: the pins are still ours
            self._send_releases(pin for pin in pins if pin is not None)
            self._send(RequestError(message.request_id, 400, str(error), param=_param_of(error)))

    def _admission(self, message: EngineRequest) -> tuple[PromptInput, Sampling]:
        """The descriptor with views of the worker's arena, and max_tokens filled in."""
        prompt = message.prompt()
        max_model_len = self.engine.max_model_len
        wanted = message.sampling.max_tokens
        too_long = context_length_error(max_model_len, len(prompt.token_ids), wanted)
        if too_long is not None:
            raise _ContextLengthError(too_long, param="max_tokens" if wanted else "messages")
        # An image without pixels (named by its uuid, evicted from the worker's cache) is
        # the engine's to serve from its embedding cache, or to refuse.
        pixels = [
            None if image.pixels is None else self.reader.view(image.pixels)
            for image in prompt.images
        ]
        max_tokens = wanted or max_model_len - len(prompt.token_ids)
        sampling = msgspec.structs.replace(
            message.sampling,
            max_tokens=max_tokens,
            min_tokens=min(message.sampling.min_tokens, max_tokens),
        )
        return PromptInput(prompt, tuple(pixels)), sampling

    # -- messages out ---------------------------------------------------------------------

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        self._send(TokenBatch(outputs))

    def _send_failures(self) -> None:
        """A 500 for each request a failed step ended (the engine logged the traceback)."""
        for failed in self.engine.pop_failed():
            self._send(
                RequestError(failed.request_id, STEP_ERROR_STATUS, failed.message, STEP_ERROR_TYPE)
            )

    def _send_stats(self) -> None:
        """Gauges for /metrics: sent when they change, at most every 0.2 s while busy, and always
        once the engine is idle (so a test sees the settled values). Encoder timings wait for a
        message that goes out, so none is lost to the rate limit; they are left out of the
        change check, and so is device memory (it changes at every step)."""
        engine = self.engine
        self._encoder_seconds.extend(engine.drain_encoder_seconds())
        stats = engine.stats()
        now = time.monotonic()
        idle = not engine.has_unfinished_requests()
        changed = stats != self._last_stats or self._encoder_seconds
        if not changed or (not idle and now - self._last_stats_time < STATS_INTERVAL_SECONDS):
            return
        self._last_stats, self._last_stats_time = stats, now
        allocated, peak = device_memory(engine.device)
        self._send(
            msgspec.structs.replace(
                stats,
                encoder_seconds=self._encoder_seconds,
                device_memory_allocated_bytes=allocated,
                device_memory_peak_bytes=peak,
            )
        )
        self._encoder_seconds = []

    def _send(self, message: ToServer) -> None:
        self.to_server.send(message)  # queued; the sender thread waits on the server

    def _release_pins(self) -> None:
        self._send_releases(self.engine.pop_released_pins())

    def _send_releases(self, pins: Iterable[ShmPointer]) -> None:
        """`ReleaseImages` to each pin's worker (the engine hands back each pin once)."""
        by_worker: dict[int, list[ShmHandle]] = {}
        for pin in pins:
            by_worker.setdefault(pin.worker_id, []).append(pin.handle)
        for worker_id, handles in by_worker.items():
            self._send_to_worker(worker_id, ReleaseImages(handles))

    def _send_to_worker(self, worker_id: int, message: ReleaseImages | CoreReady) -> None:
        try:
            self.to_workers[worker_id].send(message)
        except (IndexError, TimeoutError):
            logger.error("could not send %s to worker %d", type(message).__name__, worker_id)


class _ContextLengthError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _param_of(error: ValueError) -> str | None:
    return getattr(error, "param", None)


def device_memory(device: torch.device) -> tuple[int, int]:
    """`EngineStats`' device-memory figures, bytes allocated now and at the peak: torch's
    CUDA allocator's (zeros on CPU, where the process's RSS is the measure)."""
    if device.type != "cuda":
        return 0, 0
    allocator = torch.cuda.memory_stats(device)  # one read for both figures
    return (
        allocator.get("allocated_bytes.all.current", 0),
        allocator.get("allocated_bytes.all.peak", 0),
    )


def run_scheduler(config: SchedulerProcessConfig, ready: ReadySink) -> None:
    """Entry point of the spawned scheduler process; reports a `SchedulerReady`, or a
    `ProcessFailed`, on `ready`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C for everyone
    configure_logging(config.log_level)
    torch.set_num_threads(config.torch_threads)
    run_dir = Path(config.run_dir)
    followers: StepBroadcaster | None = None
    try:
        size, replica = config.engine.tensor_parallel_size, config.replica
        if size > 1:  # rank 0 of the group; the launcher started ranks 1..size-1
            tp = join_group(run_dir, 0, size, config.engine, replica)
            followers = StepBroadcaster(run_dir, tp, replica)
            engine = Engine(config.engine, tp, followers, replica)
        else:
            engine = Engine(config.engine, replica=replica)
        loop = SchedulerLoop(engine, run_dir, config.num_workers, replica)
        freeze_startup_heap()
    except Exception as error:
        logger.exception("%s failed to start", config.name)
        ready.put(ProcessFailed.of(config.name, error))
        raise SystemExit(1) from error

    def stop(signum: int, frame: object) -> None:
        loop.stopping = True

    signal.signal(signal.SIGTERM, stop)
    ready.put(
        SchedulerReady(
            name=config.name,
            max_model_len=engine.max_model_len,
            architecture=engine.model.config.architecture,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            kv_pages=engine.kv_cache.num_pages,
            page_size=engine.kv_cache.page_size,
            max_num_seqs=engine.config.max_num_seqs,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            quantization=engine.model.quantization,
        )
    )
    logger.info(
        "scheduler ready on %s (%s): %d KV pages of %d tokens, max_model_len %d",
        engine.device,
        engine.dtype,
        engine.kv_cache.num_pages,
        engine.kv_cache.page_size,
        engine.max_model_len,
    )
    status = 1  # an error the engine could not isolate (a poisoned CUDA context) ends here
    try:
        loop.run()
        status = 0
    except Exception:
        logger.exception("the scheduler loop failed")
    finally:
        loop.close()
        if followers is not None:
            followers.close()
        logger.info("stopped")
        logging.shutdown()
        # Skip the interpreter's teardown: a final GC can outlast the grace period.
        os._exit(status)
