"""A small Qwen2-style byte-level BPE tokenizer, trained on the committed corpus.

The pipeline (NFC normaliser, Qwen2's pre-tokenisation regex, byte-level BPE) is the one
`transformers.Qwen2Tokenizer` builds; only the vocabulary is small. The special tokens are
Qwen2-VL's, in Qwen2-VL's order, placed after the BPE vocabulary as in the real tokenizer
(there: ids 151643..151656, here: ``BPE_VOCAB_SIZE + 0..13``).
"""

from __future__ import annotations

import itertools
import json
import string
from functools import lru_cache
from importlib import resources

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import Qwen2Tokenizer

_PACKAGE = __name__.rpartition(".")[0]  # this module's package, for importlib.resources

# Same split regex as transformers' Qwen2Tokenizer (and the real Qwen2 tokenizer.json).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
PAD_TOKEN = BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# 1522 BPE entries (256 byte symbols + 1266 merges) + 14 specials = 1536 = the model's
# vocab_size, so every row of the embedding decodes to a real token.
BPE_VOCAB_SIZE = 1522
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)


def token_id(token: str, first_special_id: int = BPE_VOCAB_SIZE) -> int:
    """Id of a special token in the tiny tokenizer (no tokenizer needs to be built);
    `first_special_id` as given to `build_tokenizer`."""
    return first_special_id + SPECIAL_TOKENS.index(token)


def corpus_text() -> str:
    return resources.files(_PACKAGE).joinpath("corpus.txt").read_text(encoding="utf-8")


def chat_template() -> str:
    return resources.files(_PACKAGE).joinpath("chat_template.jinja").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _train_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Train the byte-level BPE; deterministic for a given corpus and `tokenizers` version."""
    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    if len(vocab) != BPE_VOCAB_SIZE:
        raise RuntimeError(f"corpus too small: BPE learned {len(vocab)} < {BPE_VOCAB_SIZE} entries")
    pairs = (m.split(" ") if isinstance(m, str) else m for m in model["merges"])
    merges = tuple((a, b) for a, b in pairs)
    return vocab, merges


def build_tokenizer(
    processor_class: str | None = None, first_special_id: int = BPE_VOCAB_SIZE
) -> Qwen2Tokenizer:
    """The tiny tokenizer as a transformers `Qwen2Tokenizer`, chat template attached, with
    `processor_class` recorded in tokenizer_config.json as real Qwen-VL checkpoints have it.
    `first_special_id` places the special tokens where a real-size config expects them
    (an architecture's `first_special_token_id`), padding the vocabulary with `filler_tokens` up to it."""
    vocab, merges = _train_bpe()
    vocab = {**vocab, **filler_tokens(vocab, first_special_id)}
    # Qwen2Tokenizer registers its special tokens in the order eos/unk/pad, then the extra
    # ones; building with eos=<|endoftext|> puts every special at its Qwen2-VL position.
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        # transformers annotates merges as list[str] and unk_token as str; it takes
        # (left, right) pairs and None (no unk token) as well.
        merges=list(merges),  # type: ignore[arg-type]
        unk_token=None,  # type: ignore[arg-type]
        bos_token=None,
        eos_token=PAD_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        errors="replace",
        model_max_length=32768,
        split_special_tokens=False,
    )
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.chat_template = chat_template()
    if processor_class is not None:
        tokenizer._set_processor_class(processor_class)
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    expected = [token_id(t, first_special_id) for t in SPECIAL_TOKENS]
    if ids != expected or len(tokenizer) != first_special_id + len(SPECIAL_TOKENS):
        raise RuntimeError(f"unexpected special-token layout: {ids}, len={len(tokenizer)}")
    return tokenizer


def filler_tokens(vocab: dict[str, int], first_special_id: int) -> dict[str, int]:
    """Vocabulary entries `len(vocab) .. first_special_id - 1`: a space plus a made-up
    four-letter word ("Ġaaab" decodes to " aaab"), so text decoded from a random real-size
    model reads like words. No merge produces them: they exist only to be decoded."""
    fillers: dict[str, int] = {}
    words = ("".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=4))
    while len(vocab) + len(fillers) < first_special_id:
        token = "\u0120" + next(words)  # byte-level BPE's spelling of a leading space
        if token not in vocab:
            fillers[token] = len(vocab) + len(fillers)
    return fillers
