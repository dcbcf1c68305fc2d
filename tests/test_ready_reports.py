"""The children's ready reports: typed structs through the launcher's `ReadyChannel`
(msgpack over a pipe), and what `_wait_until_ready` makes of them (no process is started)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

from iris_serve.ipc.messages import ProcessFailed, ProcessReady, SchedulerReady
from iris_serve.launch import launcher


@dataclasses.dataclass
class _Child:
    """What `_wait_until_ready` reads of a child process."""

    name: str
    exitcode: int | None = None
    pid: int = 1


def test_ready_reports_travel_typed_and_the_schedulers_limits_reach_the_server():
    scheduler = SchedulerReady(
        "scheduler", 2048, "Qwen2VLForConditionalGeneration", "cpu", "float32",
        kv_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=512,
    )  # fmt: skip
    channel = launcher.ReadyChannel(mp.get_context("spawn"))
    try:
        children = [_Child("tokenizer-0"), _Child("scheduler"), _Child("scheduler-rank1")]
        for report in (ProcessReady("tokenizer-0"), scheduler, ProcessReady("scheduler-rank1")):
            channel.put(report)
        assert launcher._wait_until_ready(children, channel, timeout=10) == {"scheduler": scheduler}
    finally:
        channel.close()


def test_a_child_that_failed_to_start_stops_the_launch(caplog):
    channel = launcher.ReadyChannel(mp.get_context("spawn"))
    try:
        channel.put(ProcessReady("tokenizer-0"))
        channel.put(ProcessFailed.of("scheduler", RuntimeError("out of memory")))
        children = [_Child("tokenizer-0"), _Child("scheduler")]
        assert launcher._wait_until_ready(children, channel, timeout=10) is None
    finally:
        channel.close()
    assert "scheduler failed to start: RuntimeError: out of memory" in caplog.text
