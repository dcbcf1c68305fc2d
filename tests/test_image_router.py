"""`ImageRouter`: a request goes to the tokenizer worker that already holds its images."""

from __future__ import annotations

from typing import Any

from iris_serve.server.image_router import (
    AFFINITY_EDGE_CHARS,
    IMBALANCE_MIN_GAP,
    ImageRouter,
    affinity_hash,
    image_urls,
)

IDLE = [0, 0, 0, 0]


def url(i: int) -> str:
    return f"https://example.com/shot-{i}.png"


def chat(*turns: list[str]) -> list[dict[str, Any]]:
    """One user message per turn with these image URLs, each answered but the last."""
    messages: list[dict[str, Any]] = []
    for urls in turns:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": "?"}]})
        messages.append({"role": "assistant", "content": "ok"})
    return messages[:-1]


def hash_worker(u: str, workers: int = 4) -> int:
    return affinity_hash(u) % workers


def test_a_new_conversation_goes_to_its_first_image_hash_and_stays_there():
    router = ImageRouter(4)
    turns: list[list[str]] = []
    picked = []
    for turn in range(8):
        turns.append([url(turn)])
        picked.append(router.pick(chat(*turns), IDLE))
    assert picked == [hash_worker(url(0))] * 8
    # The later images alone would have scattered the turns over the workers.
    assert len({hash_worker(url(i)) for i in range(8)}) > 1


def test_a_sliding_window_of_screenshots_stays_on_one_worker():
    router = ImageRouter(4)
    window = 10
    picked = [
        router.pick(chat([url(i) for i in range(step, step + window)]), IDLE) for step in range(20)
    ]
    assert picked == [hash_worker(url(0))] * 20
    # Routing by the first image, which changes at every step, would have moved it.
    assert len({hash_worker(url(step)) for step in range(20)}) > 1


def test_independent_sessions_spread_over_the_workers():
    router = ImageRouter(4)
    picked = [router.pick(chat([f"https://example.com/user-{i}.png"]), IDLE) for i in range(64)]
    assert sorted(set(picked)) == [0, 1, 2, 3]
    assert picked == [hash_worker(f"https://example.com/user-{i}.png") for i in range(64)]


def test_the_majority_of_known_images_wins_and_ties_go_to_the_earliest():
    on = {w: next(url(i) for i in range(100, 200) if hash_worker(url(i)) == w) for w in range(4)}
    router = ImageRouter(4)
    for w in range(4):
        assert router.pick(chat([on[w]]), IDLE) == w
    fresh = [f"https://example.com/fresh-{i}.png" for i in range(3)]
    # Two known images on worker 2, one on worker 1, two new ones: worker 2.
    assert router.pick(chat([on[1], fresh[0], on[2], fresh[1], on[2]]), IDLE) == 2
    # One each on workers 3 and 0: the earlier one's worker. The new image now lives there.
    assert router.pick(chat([on[3], on[0], fresh[2]]), IDLE) == 3
    assert router.pick(chat([fresh[2]]), IDLE) == 3


def test_text_only_requests_go_to_the_least_loaded_worker_in_turns():
    router = ImageRouter(3)
    assert router.pick(chat([]), [2, 0, 1]) == 1
    assert router.pick(None, [0, 5, 0]) in (0, 2)
    assert {router.pick(None, [0, 0, 0]) for _ in range(3)} == {0, 1, 2}


def test_affinity_yields_to_balance_only_when_one_worker_is_piled_up():
    router = ImageRouter(2)
    home = hash_worker(url(0), 2)
    other = 1 - home
    load = [0, 0]
    load[home] = IMBALANCE_MIN_GAP  # busy, but not past the gap: affinity holds
    assert router.pick(chat([url(0)]), load) == home
    load[home] = IMBALANCE_MIN_GAP + 5  # past the gap and the ratio: the idle worker
    assert router.pick(chat([url(0)]), load) == other
    # That request's images were sent to `other`, so its next turn follows them there.
    assert router.pick(chat([url(0)], [url(1)]), [0, 0]) == other
    load = [0, 0]
    load[other], load[home] = 90, 50  # a gap past the minimum, but within 2x: affinity holds
    assert load[other] - load[home] > IMBALANCE_MIN_GAP
    assert router.pick(chat([url(0)], [url(1)], [url(2)]), load) == other


def test_the_table_is_bounded_and_forgets_the_oldest_images():
    a = next(url(i) for i in range(100) if hash_worker(url(i), 2) == 0)
    b = next(url(i) for i in range(100) if hash_worker(url(i), 2) == 1)
    router = ImageRouter(2, capacity=4)
    assert router.pick(chat([a, b]), [0, 0]) == 0  # b is remembered on worker 0
    assert router.pick(chat([b]), [0, 0]) == 0
    for i in range(4):  # four newer images push b out of the table
        router.pick(chat([f"https://example.com/filler-{i}.png"]), [0, 0])
    assert router.pick(chat([b]), [0, 0]) == 1  # back to its own hash


def test_affinity_hash_is_cheap_on_long_data_urls():
    head, tail = "data:image/png;base64," + "A" * 5000, "Z" * 5000
    one, two = head + "B" * 3_000_000 + tail, head + "C" * 3_000_000 + tail
    assert affinity_hash(one) == affinity_hash(two)  # only the ends and the length count
    assert affinity_hash(one) != affinity_hash(one + "=")
    assert affinity_hash(head) != affinity_hash(head[:-1] + "B")
    short = "x" * (2 * AFFINITY_EDGE_CHARS)  # hashed whole
    assert affinity_hash(short) != affinity_hash("y" + short[1:])
    assert isinstance(affinity_hash("file:///\ud800.png"), int)  # a lone surrogate from JSON


def test_image_urls_reads_parts_as_the_worker_does():
    parts = [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": "plain-string-url"},
        {"type": "image", "image": "second"},  # not a type Iris takes: routing skips it
        {"type": "image_url", "image_url": {"url": "third"}},
        {"type": "image_url"},  # malformed: the worker rejects it, routing skips it
        {"type": "video_url", "video_url": {"url": "a video"}},  # no image
        "not a part",
    ]
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": parts}]
    assert image_urls(messages) == ["plain-string-url", "third"]
    assert image_urls([{"role": "user", "content": [{"type": "image"}]}]) == []
