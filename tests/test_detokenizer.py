"""Incremental detokenization and stop strings against the tiny byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from iris_serve.server.detokenizer import IncrementalDetokenizer, TextStream
from iris_serve.tiny_checkpoint.tokenizer import token_id

TEXTS = [
    "Hello world, how are you?",
    "Hi 😀 世界! ünïcödé — ok",
    "👍🏽👩‍👩‍👧 and 漢字かな交じり文",
]


@pytest.fixture(scope="module")
def tokenizer(qwen2_vl_tiny: Path):
    return AutoTokenizer.from_pretrained(qwen2_vl_tiny)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push([i]) for i in ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_split_emoji_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode(" 😀")
    assert len(ids) >= 2  # the tiny vocabulary splits the emoji's four bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == " 😀"


def test_many_tokens_at_once_and_an_unfinished_character_at_the_end(tokenizer):
    ids = tokenizer.encode("ab 😀")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[:-1]) == "ab"  # the emoji's first bytes wait
    assert detokenizer.flush() == " \ufffd"  # the request ended mid-character


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = [*tokenizer.encode("Hi"), token_id("<|im_end|>")]
    skipping = IncrementalDetokenizer(tokenizer)
    assert "".join(skipping.push([i]) for i in ids) == "Hi"
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(keeping.push([i]) for i in ids) == "Hi<|im_end|>"


def test_each_step_decodes_a_short_window(tokenizer):
    """O(1) per token: the re-decoded window never grows with the output."""
    ids = tokenizer.encode(" ".join(TEXTS) * 40)
    assert len(ids) > 1000
    detokenizer = IncrementalDetokenizer(tokenizer)
    decode, windows = detokenizer._decode, []

    def recording(token_ids: list[int]) -> str:
        windows.append(len(token_ids))
        return decode(token_ids)

    detokenizer._decode = recording
    text = "".join(detokenizer.push([i]) for i in ids)
    assert text == tokenizer.decode(ids)
    assert max(windows) <= 8


def _stream(tokenizer, text: str, stop: list[str], finish_reason: str = "length"):
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, stop=stop)
    pieces = []
    for n, i in enumerate(ids):
        last = n == len(ids) - 1
        pieces.append(stream.update([i], finish_reason=finish_reason if last else None))
        if stream.stopped:
            break
    return stream, pieces


def test_stop_string_across_token_boundaries_is_cut_exactly(tokenizer):
    # "Hello world" is H|el|lo| wor|ld: the stop string "lo w" spans two tokens.
    stream, pieces = _stream(tokenizer, "Hello world", ["lo w"])
    assert stream.stopped and stream.text == "Hel"
    assert pieces == ["H", "e", "l", ""]  # "l", then "lo" held back: it may start "lo w"


def test_stop_string_inside_one_token_and_the_earliest_of_several_wins(tokenizer):
    stream, _ = _stream(tokenizer, "The end. STOP here", ["here", "STOP"])
    assert stream.stopped and stream.text == "The end. "


def test_stop_string_made_of_a_multibyte_character(tokenizer):
    stream, _ = _stream(tokenizer, "Hi 😀 世界!", ["😀"])
    assert stream.stopped and stream.text == "Hi "


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer):
    stream, pieces = _stream(tokenizer, "Hello world", ["lo there", "xyz"])
    assert not stream.stopped
    assert "".join(pieces) == stream.text == "Hello world"


def test_held_back_prefix_is_released_at_the_finish(tokenizer):
    stream, pieces = _stream(tokenizer, "Hello wor", ["world"])
    assert not stream.stopped and pieces[-1].endswith("wor")
    assert stream.text == "Hello wor"


def test_whole_output_at_once_gives_the_same_text(tokenizer):
    ids = tokenizer.encode("The end. STOP here")
    stream = TextStream(tokenizer, stop=["STOP"])
    assert stream.update(ids, finish_reason="length") == "The end. "
    assert stream.stopped
    assert stream.update(tokenizer.encode("more")) == ""


def test_the_stop_token_of_a_stop_finish_is_not_text(tokenizer):
    ids = tokenizer.encode("Hello!")
    stream = TextStream(tokenizer, skip_special_tokens=False)
    assert stream.update(ids[:-1]) + stream.update(ids[-1:], finish_reason="stop") == "Hello"
