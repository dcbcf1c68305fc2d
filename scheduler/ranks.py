"""Tensor parallelism across processes: the process group, rank 0's per-step message,
and the follower ranks' loop (`docs/scale-out.md`, "Tensor parallelism", the step).

    rank 0 (the scheduler)                          rank r > 0 (a follower)
    plan → encode images → StepInputs
    RankStep ──────────── ZMQ (msgspec) ──────────► pages mirrored, StepInputs rebuilt
    image rows ─────── torch.distributed.broadcast ► (embeddings, never pixels)
    forward ◄──── all-reduce / all-gather ────────► forward
    sample

A follower decides nothing: it keeps the page lists of the running sequences as rank 0
tells it (`RankChunk`) and makes the device work rank 0's plan carries (host copies, slot
clears and copies) in the runner's own `forward`, as rank 0 does, so nothing on it can
drift. The step message travels over ZMQ
rather than a collective so an idle follower waits in a poll, never inside a collective
with a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import zmq

from ..ipc.codec import pack_token_ids
from ..ipc.messages import (
    TO_FOLLOWER,
    ProcessFailed,
    ProcessReady,
    RankChunk,
    RankStep,
    ReadySink,
    StopRanks,
)
from ..ipc.sockets import PullSocket, PushSocket, ipc_address
from .attention import SequenceChunk
from .config import EngineConfig
from .device_state import DeviceState, rank_device
from .hybrid.linear_state import SequenceStates
from .hybrid.state_slots import SlotOp
from .kv.host_tier import HostCopy
from .kv.page_table import PageTable
from .models.tensor_parallel import TPShard
from .step.batch_planner import StepPlan
from .step.model_runner import ModelRunner, StepInputs
from .step.request import Request

logger = logging.getLogger("iris.ranks")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one step's collectives, never an idle wait
IDLE_POLL_SECONDS = 0.1
_INT32 = np.dtype("<i4")


def join_group(
    run_dir: Path, rank: int, size: int, config: EngineConfig, replica: int = 0
) -> TPShard:
    """Joins data-parallel replica `replica`'s tensor-parallel group (a rendezvous file in
    the server's run folder); NCCL where the ranks run on GPUs, gloo on the CPU."""
    device = rank_device(config.resolved_device(), replica * size + rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{run_dir / f'tp-rendezvous-{replica}'}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return TPShard(rank, size)


def follower_address(run_dir: Path, rank: int, replica: int = 0) -> str:
    return ipc_address(run_dir, f"rank-{replica}-{rank}")


@dataclass
class _Sent:
    request: Request
    epoch: int
    num_pages: int


class StepBroadcaster:
    """Rank 0's side: each step's `RankStep` to every follower, then its image rows."""

    def __init__(self, run_dir: Path, tp: TPShard, replica: int = 0) -> None:
        self.tp = tp
        self._context = zmq.Context()  # its own, so `close` can wait for the last message
        self.sockets = [
            PushSocket(TO_FOLLOWER, follower_address(run_dir, rank, replica), ctx=self._context)
            for rank in range(1, tp.size)
        ]
        self._sent: dict[str, _Sent] = {}
        self.num_steps = 0
        # the last step's message size and `send` time (encoding, ZMQ sends, image rows):
        # rank 0's per-step cost of tensor parallelism beyond the collectives; bounded
        # state, read by bench.tensor_parallel and the tests
        self.last_message_bytes = 0
        self.last_send_seconds = 0.0
        self.max_message_bytes = 0

    def send(self, plan: StepPlan, inputs: StepInputs) -> None:
        started = time.perf_counter()
        message = self.message(plan, inputs)
        data = TO_FOLLOWER.encode(message)
        self.last_message_bytes = len(data)
        self.max_message_bytes = max(self.max_message_bytes, len(data))
        for socket in self.sockets:
            socket.send_encoded(data)
        if inputs.image_embeddings is not None:
            torch.distributed.broadcast(inputs.image_embeddings.contiguous(), src=0)
        self.last_send_seconds = time.perf_counter() - started

    def message(self, plan: StepPlan, inputs: StepInputs) -> RankStep:
        chunks = []
        linear: list[SequenceStates | None] = (
            list(inputs.linear) if inputs.linear is not None else [None] * len(plan.chunks)
        )
        for chunk, sequence, states in zip(plan.chunks, inputs.chunks, linear, strict=True):
            request = chunk.request
            table = request.page_table
            sent = self._sent.get(request.request_id)
            reset = sent is None or sent.request is not request or sent.epoch != table.epoch
            first = 0 if reset or sent is None else sent.num_pages
            chunks.append(
                RankChunk(
                    request.request_id,
                    pack_token_ids(table.pages[first:]),
                    sequence.num_cached,
                    sequence.num_new,
                    reset,
                    -1 if states is None else states.slot,
                    [] if states is None else list(states.captures),
                )
            )
            self._sent[request.request_id] = _Sent(request, table.epoch, len(table.pages))
        dropped = [
            request_id
            for request_id, sent in self._sent.items()
            if sent.request.finish_reason is not None
        ]
        for request_id in dropped:
            del self._sent[request_id]
        self.num_steps += 1
        ids = inputs.input_ids if inputs.host_input_ids is None else inputs.host_input_ids
        positions = inputs.positions if inputs.host_positions is None else inputs.host_positions
        return RankStep(
            step=self.num_steps,
            input_ids=pack_token_ids(ids if isinstance(ids, list) else ids.tolist()),
            positions=_int32_bytes(positions),
            chunks=chunks,
            image_rows=inputs.image_rows,
            logit_rows=pack_token_ids(inputs.logit_rows),
            dropped=dropped,
            slot_ops=[
                (op.target, -1 if op.source is None else op.source) for op in inputs.slot_ops
            ],
            host_copies=[(c.kind, c.device, c.host) for c in inputs.host_copies],
        )

    def close(self) -> None:
        """Tells the followers to stop, waiting at most a second for the message to leave
        (a follower that is gone is not waited for)."""
        for socket in self.sockets:
            with contextlib.suppress(TimeoutError):
                socket.send(StopRanks())
            socket.close(linger=1.0)
        self._context.term()  # returns once every queued message is out, or lingered


class Follower:
    """A rank > 0: rebuilds each step's `StepInputs` from rank 0's message and runs its
    shard of the forward pass."""

    def __init__(self, state: DeviceState) -> None:
        self.state = state
        self.runner = ModelRunner(
            state.model,
            state.attention,
            state.device,
            state.dtype,
            decode_graphs=state.decode_graphs,
            linear_states=state.linear_states,
            host_memory=state.host_memory,
        )
        config = state.model.config
        self.embedding_width = config.hidden_size * (1 + config.deepstack_levels)
        self.tables: dict[str, PageTable] = {}

    def run_step(self, message: RankStep) -> None:
        device = self.state.device
        for request_id in message.dropped:
            self.tables.pop(request_id, None)
        if message.host_copies:
            assert self.state.host_memory is not None, "rank 0 has a host tier: so has every rank"
        ids = _tensor(message.input_ids, device)
        image_embeddings = None
        num_image_rows = sum(end - start for start, end in message.image_rows)
        if num_image_rows:
            image_embeddings = torch.empty(
                num_image_rows, self.embedding_width, dtype=self.state.dtype, device=device
            )
            torch.distributed.broadcast(image_embeddings, src=0)
        inputs = StepInputs(
            input_ids=ids,
            positions=_tensor(message.positions, device).view(3, -1),
            chunks=[self._sequence(chunk) for chunk in message.chunks],
            image_rows=[tuple(rows) for rows in message.image_rows],  # type: ignore[misc]
            image_embeddings=image_embeddings,
            logit_rows=np.frombuffer(message.logit_rows, dtype=_INT32).tolist(),
            host_copies=[HostCopy(*copy) for copy in message.host_copies],  # type: ignore[arg-type]
        )
        if self.state.linear_states is not None:
            inputs.linear = [
                SequenceStates(
                    c.state_slot, c.num_new, tuple((k, slot) for k, slot in c.state_captures)
                )
                for c in message.chunks
            ]
            inputs.slot_ops = [
                SlotOp(target, None if source < 0 else source)
                for target, source in message.slot_ops
            ]
        self.runner.forward(inputs)  # the plan's device work first, as on rank 0

    def _sequence(self, chunk: RankChunk) -> SequenceChunk:
        table = self.tables.get(chunk.request_id)
        if chunk.reset or table is None:
            if not chunk.reset:
                raise RuntimeError(f"rank 0 extended pages of unknown request {chunk.request_id}")
            table = self.tables[chunk.request_id] = PageTable()
        table.extend(np.frombuffer(chunk.new_pages, dtype=_INT32).tolist())
        return SequenceChunk(table.pages, table.runs, chunk.num_cached, chunk.num_new)


def run_follower(
    engine: EngineConfig,
    run_dir: str,
    rank: int,
    threads: int,
    ready: ReadySink,
    replica: int = 0,
    name: str | None = None,
) -> None:
    """Entry point of a spawned follower rank of data-parallel replica `replica`; reports
    a `ProcessReady`, or a `ProcessFailed`, on `ready`."""
    name = name or f"scheduler-rank{rank}"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C for everyone
    torch.set_num_threads(threads)
    try:
        tp = join_group(Path(run_dir), rank, engine.tensor_parallel_size, engine, replica)
        follower = Follower(DeviceState.build(engine, tp, replica))
        inbox = PullSocket(TO_FOLLOWER, follower_address(Path(run_dir), rank, replica))
    except Exception as error:
        logger.exception("%s failed to start", name)
        ready.put(ProcessFailed.of(name, error))
        raise SystemExit(1) from error
    ready.put(ProcessReady(name))
    logger.info("%s ready on %s", name, follower.state.device)
    status = 1
    parent = os.getppid()
    try:
        while os.getppid() == parent:
            message = inbox.recv(IDLE_POLL_SECONDS)
            if isinstance(message, StopRanks):
                status = 0
                break
            if message is not None:
                follower.run_step(message)
    except Exception:
        logger.exception("%s failed", name)
    finally:
        inbox.close()
        logging.shutdown()
        os._exit(status)  # no interpreter teardown: the process group is not destroyed in step


def _int32_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(device="cpu", dtype=torch.int32).numpy().tobytes()


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=_INT32).astype(np.int64)).to(device)
