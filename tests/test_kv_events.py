"""KV events (`--kv-events-config`, scheduler/kv/kv_events.py): what a cluster router is
told of the prefix cache, in vLLM's wire format.

A router follows these to send a request where its prefix is cached, so: every full page
cached is announced once per routing identity of its images, with the tokens and image
ids the router hashes; an eviction removes exactly what was announced for that page; the
stream carries sequence numbers and replays what a late subscriber missed.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
import zmq

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Prompt, Sampling
from iris_serve.scheduler.kv.event_publisher import KvEventsConfig, ZmqEventPublisher
from iris_serve.scheduler.kv.kv_events import (
    HOST_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tests.reference import chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)
GREEDY = Sampling(temperature=0.0, max_tokens=4)
EVENTS = '{"endpoint": "tcp://127.0.0.1:1"}'  # on: the engine only records them


def with_routing(prompt: PromptInput, routing: int) -> PromptInput:
    images = [msgspec.structs.replace(image, routing_hash=routing) for image in prompt.images]
    return PromptInput(Prompt(prompt.token_ids, images), prompt.pixels)


def run(engine, request_id: str, prompt: PromptInput) -> list:
    engine.add_request(request_id, prompt, GREEDY)
    for _ in engine.run_until_idle():
        pass
    return engine.take_kv_events()


def stored(events: list) -> list[BlockStored]:
    return [event for event in events if isinstance(event, BlockStored)]


def test_full_pages_are_announced_with_their_tokens_and_image_ids(model_dir, builder) -> None:
    engine = cpu_engine(model_dir, kv_events_config=EVENTS)
    prompt = with_routing(chat_prompt(builder, "describe it " * 4, [make_image(112, 112)]), 77)
    events = run(engine, "a", prompt)
    assert isinstance(events[0], AllBlocksCleared)  # a router forgets what it knew of us
    blocks = stored(events)
    ids = [block_id for event in blocks for block_id in event.block_hashes]
    tokens = [token for event in blocks for token in event.token_ids]
    assert len(ids) == len(set(ids)) == (len(prompt.token_ids) + GREEDY.max_tokens - 1) // 16
    assert tokens == prompt.token_ids[: len(tokens)]
    assert blocks[0].parent_block_hash is None
    for before, after in itertools.pairwise(blocks):
        assert after.parent_block_hash == before.block_hashes[-1]
    image = prompt.images[0]
    infos = [i for e in blocks for i in (e.block_mm_infos or [None] * len(e.block_hashes))]
    keys = [k for e in blocks for k in (e.extra_keys or [None] * len(e.block_hashes))]
    with_image = [index for index in range(len(ids)) if image.overlaps(index * 16, index * 16 + 16)]
    for index, (info, key) in enumerate(zip(infos, keys, strict=True)):
        if index not in with_image:
            assert info is None and key is None
            continue
        start = max(image.offset - index * 16, 0)
        end = min(image.end - index * 16, 16)
        assert info == {"mm_objects": [{"mm_hash": 77, "offsets": [[start, end]]}]}
        identifier, offset = key[0]
        assert int(identifier[:16], 16) == 77 and identifier[16:48] == image.key.hex()
        assert offset == start
    assert engine.kv_events.num_blocks == len(ids)


def test_a_cached_image_reached_under_another_id_is_announced_again(model_dir, builder) -> None:
    engine = cpu_engine(model_dir, kv_events_config=EVENTS)
    text = "a long shared preamble about the screen " * 3
    prompt = chat_prompt(builder, text, [make_image(112, 112)])
    first = stored(run(engine, "a", with_routing(prompt, 1)))
    same = stored(run(engine, "b", with_routing(prompt, 1)))
    other = stored(run(engine, "c", with_routing(prompt, 2)))
    first_ids = {block_id for event in first for block_id in event.block_hashes}
    other_ids = [block_id for event in other for block_id in event.block_hashes]
    # the same prompt under the same id: only its own answer's page, if any, is new
    assert not {block_id for event in same for block_id in event.block_hashes} & first_ids
    image_page = prompt.images[0].offset // 16
    assert other_ids, "the pages at and after the image are new to the router under id 2"
    assert not set(other_ids) & first_ids
    assert other[0].parent_block_hash == (
        None if image_page == 0 else sorted_ids(first)[image_page - 1]
    )


def sorted_ids(events: list[BlockStored]) -> list[int]:
    return [block_id for event in events for block_id in event.block_hashes]


def test_an_evicted_page_removes_every_id_announced_for_it(model_dir, builder) -> None:
    probe = cpu_engine(model_dir)
    page_bytes = (16 << 20) // probe.kv_cache.num_pages
    # 8 pages of KV: each new prompt evicts earlier ones' pages
    engine = cpu_engine(model_dir, kv_events_config=EVENTS, kv_cache_memory=8 * page_bytes)
    live: set[int] = set()
    for index in range(4):
        prompt = chat_prompt(
            builder, f"prompt number {index} " * 6, [make_image(56, 56, seed=index)]
        )
        for event in run(engine, f"r{index}", with_routing(prompt, index)):
            if isinstance(event, BlockStored):
                assert not live & set(event.block_hashes), "announced twice"
                live |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= live, "removed what was never announced"
                live -= set(event.block_hashes)
    assert live and len(live) == engine.kv_events.num_blocks
    assert len(live) <= engine.kv_cache.num_pages


def test_the_stream_has_sequence_numbers_and_replays_what_was_missed(tmp_path) -> None:
    config = KvEventsConfig.parse(
        f'{{"endpoint": "ipc://{tmp_path}/events", "replay_endpoint": "ipc://{tmp_path}/replay",'
        ' "topic": "kv"}'
    )
    publisher = ZmqEventPublisher(config, replica=1)
    assert publisher.endpoint == f"ipc://{tmp_path}/events_dp1"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    replay = context.socket(zmq.DEALER)
    replay.connect(f"ipc://{tmp_path}/replay_dp1")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        publisher.publish([AllBlocksCleared()])  # perhaps before the SUB joined: replay has it
        received = []
        for _ in range(200):  # a SUB joins asynchronously: publish until it hears one
            publisher.publish([BlockRemoved([len(received) + 5])])
            if sub.poll(10):
                received.append(sub.recv_multipart())
                break
        topic, sequence, payload = received[0]
        number = int.from_bytes(sequence, "big", signed=True)
        batch = decoder.decode(payload)
        assert topic == b"kv" and batch.data_parallel_rank == 1
        assert batch.events[0][0] == ("AllBlocksCleared" if number == 0 else "BlockRemoved")
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = []
        while not frames or frames[-1][1] != (-1).to_bytes(8, "big", signed=True):
            for _ in range(200):
                publisher.publish([])  # the replay is answered between steps
                if replay.poll(10):
                    break
            frames.append(replay.recv_multipart())
        first = decoder.decode(frames[0][2])
        assert int.from_bytes(frames[0][1], "big") == 0 and first.events[0][0] == "AllBlocksCleared"
        numbers = [int.from_bytes(f[1], "big", signed=True) for f in frames[:-1]]
        assert numbers == list(range(len(numbers)))
    finally:
        sub.close(0)
        replay.close(0)
        context.term()
        publisher.close()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"endpoint": "tcp://*:5557", "bogus": 1}', "bogus"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "udp://x:1"}', "udp://x:1"),
        ("[1]", "JSON object"),
    ],
)
def test_a_bad_kv_events_config_refuses_to_start_naming_what_is_wrong(text, field) -> None:
    with pytest.raises(ValueError, match=field):
        KvEventsConfig.parse(text)


def test_the_host_tier_is_its_own_medium(model_dir, builder) -> None:
    """An evicted page the host tier takes moves to the host's medium under the same ids;
    the tier's own drops remove it there; a returning prompt reloaded from the host is
    announced on the device again."""
    probe = cpu_engine(model_dir)
    page_bytes = (16 << 20) // probe.kv_cache.num_pages
    engine = cpu_engine(
        model_dir, kv_events_config=EVENTS, kv_cache_memory=8 * page_bytes,
        kv_offload_bytes=12 * page_bytes,
    )  # fmt: skip
    device: set[int] = set()
    host: set[int] = set()
    ever_on_device: set[int] = set()

    def follow(events: list) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                on = host if event.medium == HOST_MEDIUM else device
                assert not on & set(event.block_hashes), "announced twice on one medium"
                on |= set(event.block_hashes)
                if on is host:  # a page reaches the host only from the device
                    assert set(event.block_hashes) <= ever_on_device - device
                    assert event.token_ids and len(event.block_hashes) == 1
                ever_on_device.update(device)
            elif isinstance(event, BlockRemoved):
                on = host if event.medium == HOST_MEDIUM else device
                assert set(event.block_hashes) <= on, "removed what was never announced"
                on -= set(event.block_hashes)

    texts = [f"prompt number {i} " * 6 for i in range(5)]
    prompts = [
        with_routing(chat_prompt(builder, text, [make_image(56, 56, seed=i)]), i)
        for i, text in enumerate(texts)
    ]
    for index, prompt in enumerate(prompts):
        follow(run(engine, f"r{index}", prompt))
    assert host, "evicted pages went to the host tier's medium"
    assert len(host) == engine.kv_events.num_host_blocks <= engine.host_tier.num_pages
    assert len(device) == engine.kv_events.num_blocks
    back = set()
    for event in run(engine, "again", prompts[-2]):  # spilled a while ago, reloaded now
        follow([event])
        if isinstance(event, BlockStored) and event.medium is None:
            back |= set(event.block_hashes)
    assert back & host, "a page reloaded from the host is on both media"
