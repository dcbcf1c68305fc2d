"""`PushThread`: the scheduler's outputs are queued, sent in order by one thread, never
dropped while the server is slow, and closing never hangs on a peer that is gone."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from iris_serve.ipc import push_thread
from iris_serve.ipc.messages import TO_SERVER, RequestOutput, TokenBatch
from iris_serve.ipc.push_thread import PushThread
from iris_serve.ipc.sockets import PullSocket, ipc_address

WAIT = 10.0


@pytest.fixture
def address() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="iris-") as run_dir:  # ipc paths are short
        yield ipc_address(Path(run_dir), "server")


def batch(i: int, size: int = 1) -> TokenBatch:
    return TokenBatch([RequestOutput(f"r{i}", list(range(i, i + size)))])


def wait_until(condition, what: str, timeout: float = WAIT) -> None:
    """Polls `condition` (another thread's progress) until it holds; bounded."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout} s")
        time.sleep(0.005)  # a poll interval, not the synchronisation itself


def test_a_peer_that_reads_nothing_for_a_while_loses_no_message(address, monkeypatch):
    """Both sides hold one message and 30 MB outgrow the kernel's socket buffers, so the
    sender is soon stuck; it waits through many send slices (the old socket dropped a
    message after one) and everything arrives in order once the peer reads."""
    monkeypatch.setattr(push_thread, "RETRY_SECONDS", 0.01)
    sent = [batch(i, size=200_000) for i in range(30)]  # ~1 MB each on the wire
    with PullSocket(TO_SERVER, address, hwm=1) as peer:
        sender = PushThread(TO_SERVER, address, hwm=1)
        try:
            for message in sent:
                sender.send(message)  # returns at once: the loop never waits on the peer
            wait_until(lambda: sender.num_send_timeouts >= 20, "twenty timed-out send slices")
            received = []
            for _ in sent:
                message = peer.recv(WAIT)
                assert message is not None, f"message {len(received)} never arrived"
                received.append(message)
        finally:
            sender.close()
    assert received == sent


def test_close_sends_what_was_queued_then_stops(address):
    with PullSocket(TO_SERVER, address) as peer:
        sender = PushThread(TO_SERVER, address)
        for i in range(50):
            sender.send(batch(i))
        sender.close()
        assert not sender._thread.is_alive()
        received = [peer.recv(WAIT) for _ in range(50)]
    assert received == [batch(i) for i in range(50)]
    with pytest.raises(RuntimeError, match="not running"):
        sender.send(batch(50))
    sender.close()  # twice is fine


def test_close_gives_up_on_a_peer_that_is_gone(address, monkeypatch, caplog):
    """Nobody binds the address: what does not fit in the socket is dropped (logged) once
    `close_timeout` has passed, and close returns."""
    monkeypatch.setattr(push_thread, "RETRY_SECONDS", 0.01)
    sender = PushThread(TO_SERVER, address, hwm=1, close_timeout=0.2)
    for i in range(20):
        sender.send(batch(i))
    began = time.monotonic()
    sender.close()
    assert not sender._thread.is_alive()
    assert time.monotonic() - began < WAIT
    assert "dropped" in caplog.text


def test_a_message_changed_after_send_goes_out_as_it_was_sent(address):
    with PullSocket(TO_SERVER, address) as peer:
        sender = PushThread(TO_SERVER, address)
        message = batch(1)
        sender.send(message)
        message.outputs.append(RequestOutput("later", [2]))
        sender.close()
        assert peer.recv(WAIT) == batch(1)
