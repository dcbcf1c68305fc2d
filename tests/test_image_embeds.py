"""`image_embeds` content parts: the worker reads and checks the client's tensors, the
engine takes them into its embedding cache. Embeddings computed by the model's own
vision tower give the answer the image gives."""

from __future__ import annotations

import base64
import io
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import save

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import (
    EngineRequest,
    ReleaseImages,
    RequestError,
    Sampling,
    TokenizeRequest,
)
from iris_serve.ipc.shm_arena import ShmReader
from iris_serve.scheduler.encoder.given_images import RefusedImage
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import cpu_engine, make_image
from tests.worker_harness import worker_factory

MiB = 1 << 20
SAMPLING = Sampling(max_tokens=6, temperature=0.0)
GRID = [1, 4, 6]  # 6 tokens after the 2x2 merge


def b64(tensor: torch.Tensor, form: str = "torch") -> str:
    if form == "torch":
        out = io.BytesIO()
        torch.save(tensor, out)
        raw = out.getvalue()
    elif form == "safetensors":
        raw = save({"image_embeds": tensor.contiguous()})
    else:
        out = io.BytesIO()
        np.save(out, tensor.numpy())
        raw = out.getvalue()
    return base64.b64encode(raw).decode()


def embeds_part(tensor: torch.Tensor, grid: Any = GRID, **extra: Any) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": b64(tensor), "image_grid_thw": grid, **extra}


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]


def ask(worker: TokenizerWorker, *parts: dict[str, Any]) -> Any:
    rid = f"r{worker.requests_processed}"
    return worker.handle(TokenizeRequest(rid, SAMPLING, messages=chat(*parts)))


@pytest.fixture(scope="module")
def builder(qwen2_5_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_5_vl_tiny)


@pytest.fixture
def make_worker(builder: PromptBuilder, tmp_path: Path) -> Iterator[Callable[..., TokenizerWorker]]:
    instance = f"test-{uuidlib.uuid4().hex[:12]}"
    with worker_factory(builder, instance, tmp_path, enable_mm_embeds=True) as make:
        yield lambda **config: make(16 * MiB, **config)


def test_embeds_are_off_unless_enabled(make_worker):
    out = ask(make_worker(enable_mm_embeds=False), embeds_part(torch.zeros(6, 8)))
    assert isinstance(out, RequestError) and (out.status, out.param) == (
        400,
        "messages[0].content[0]",
    )
    assert "image_embeds" in out.message and "--enable-mm-embeds" in out.message


def test_every_form_of_the_same_tensor_is_one_image_in_the_arena(make_worker):
    worker = make_worker()
    tensor = torch.randn(6, 8)
    forms = [
        embeds_part(tensor),
        {
            "type": "image_embeds",
            "image_embeds": b64(tensor, "safetensors"),
            "image_grid_thw": GRID,
        },
        {"type": "image_embeds", "image_embeds": b64(tensor, "npy"), "image_grid_thw": GRID},
        {  # vLLM's: both tensors torch-saved
            "type": "image_embeds",
            "image_embeds": {
                "image_embeds": b64(tensor),
                "image_grid_thw": b64(torch.tensor(GRID)),
            },
        },
    ]
    out = ask(worker, *forms)
    assert isinstance(out, EngineRequest), out
    assert len({image.key for image in out.images}) == 1
    with ShmReader() as reader:
        for image in out.images:
            assert image.embeds and image.length == 6 and image.grid_thw == tuple(GRID)
            assert image.pixels is not None
            assert torch.equal(reader.view(image.pixels), tensor)
    worker.release(ReleaseImages([image.pixels.handle for image in out.images]))
    assert worker.arena.usage_bytes == 0  # anonymous entries: never a processor-cache hit


BAD = {
    "rows": (embeds_part(torch.zeros(5, 8)), "do not fit image_grid_thw"),
    "dtype": (embeds_part(torch.zeros(6, 8, dtype=torch.int32)), "float16, bfloat16 or float32"),
    "merge": (embeds_part(torch.zeros(6, 8), grid=[1, 3, 8]), "multiples of the merge size"),
    "frames": (embeds_part(torch.zeros(12, 8), grid=[2, 4, 6]), "t = 1"),
    "grid": (embeds_part(torch.zeros(6, 8), grid=[1, 4]), "3 positive integers"),
    "base64": ({"type": "image_embeds", "image_embeds": "@@", "image_grid_thw": GRID}, "base64"),
    "bytes": (
        {"type": "image_embeds", "image_embeds": "aGVsbG8=", "image_grid_thw": GRID},
        "not a tensor saved by",
    ),
    "neither": ({"type": "image_embeds"}, "needs its data"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_embeds_are_400s_naming_the_part_and_leak_nothing(make_worker, case):
    worker = make_worker()
    part, message = BAD[case]
    out = ask(worker, part)
    assert isinstance(out, RequestError), out
    assert (out.status, out.param) == (400, "messages[0].content[0]")
    assert message in out.message, out.message
    assert worker.arena.usage_bytes == 0


def test_embeds_over_the_byte_limit_are_refused(make_worker):
    out = ask(make_worker(max_image_bytes=1000), embeds_part(torch.zeros(6, 64)))
    assert isinstance(out, RequestError) and "1000-byte limit" in out.message


def test_a_uuid_names_embeds_too(make_worker):
    worker = make_worker()
    first = ask(worker, embeds_part(torch.randn(6, 8), uuid="e"))
    later = ask(worker, {"type": "image_embeds", "image_embeds": None, "uuid": "e"})
    assert isinstance(later, EngineRequest), later
    assert later.images[0].key == first.images[0].key
    assert later.images[0].pixels is None  # the scheduler's embedding cache serves it
    worker.release(ReleaseImages([first.images[0].pixels.handle]))


# --- the engine ---------------------------------------------------------------------------


def image_prompt(builder: PromptBuilder) -> PromptInput:
    content = [{"type": "image"}, {"type": "text", "text": "Describe."}]
    return builder.build(builder.render_chat([{"role": "user", "content": content}]),
                         [make_image(64, 48, seed=8)])  # fmt: skip


def vision_tower(engine: Engine, prompt: PromptInput) -> torch.Tensor:
    [pixels], [image] = prompt.pixels, prompt.images
    assert pixels is not None
    with torch.no_grad():
        pixel_values = engine.patches([pixels], [image.grid_thw])
        return engine.model.encode_images(pixel_values, torch.tensor([image.grid_thw])).clone()


def as_embeds(prompt: PromptInput, embedding: torch.Tensor, key: bytes = b"e" * 16) -> PromptInput:
    [image] = prompt.images
    ref = msgspec.structs.replace(image, key=key, embeds=True)
    return PromptInput(msgspec.structs.replace(prompt.prompt, images=[ref]), (embedding,))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])  # Qwen3-VL: DeepStack levels
def test_embeds_from_the_vision_tower_answer_as_the_image_does(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    builder = PromptBuilder(model_dir)
    engine = cpu_engine(model_dir, enable_prefix_caching=False)
    prompt = image_prompt(builder)
    embedding = vision_tower(engine, prompt)
    [from_image, from_embeds] = engine.generate([prompt, as_embeds(prompt, embedding)], SAMPLING)
    assert from_embeds == from_image
    assert engine.stats().images_encoded == 1  # the image's; the embeds were not encoded
    half = engine.generate([as_embeds(prompt, embedding.half(), b"h" * 16)], SAMPLING)[0]
    assert len(half) == len(from_image)  # another dtype is cast to the model's
    assert engine.embedding_cache.get(b"h" * 16).dtype == torch.float32
    assert engine.pop_released_pins() == [] and engine.embedding_cache.num_held == 0


def test_embeds_of_another_width_are_refused_holding_nothing(qwen2_5_vl_tiny, builder):
    engine = cpu_engine(qwen2_5_vl_tiny)
    prompt = image_prompt(builder)
    wrong = torch.zeros(prompt.images[0].length, 3)
    with pytest.raises(RefusedImage, match="do not fit this model"):
        engine.add_request("x", as_embeds(prompt, wrong), SAMPLING)
    assert not engine.requests and len(engine.embedding_cache) == 0
