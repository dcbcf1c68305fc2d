"""A pruned video (`--video-pruning-rate`) through the engine and over HTTP, against a
reference that runs transformers' model by hand on the pruned inputs: the vision tower on
every whole temporal patch, the kept rows of its output (and of each DeepStack level)
spliced into the pruned prompt's placeholder rows, Iris's positions, greedy fp32, the
whole prompt again for each new token. At q=0 that reference is transformers' own
`generate` (checked here), so it holds no rule of Iris's but the positions, which
tests/test_video_pruning.py holds to the unpruned ones.

Over HTTP, on the tiny Qwen3-VL checkpoint: the served answer is the reference's, and a
second question about the same video encodes no temporal patch and finds its KV in the
prefix cache."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
import torch

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import EngineRequest, Prompt, Sampling, TokenizeRequest
from iris_serve.ipc.shm_arena import ShmReader
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import (
    cpu_engine,
    hf_generate,
    hf_model,
    hf_video_block_logits,
    hf_video_pixel_values,
    prompt_positions,
)
from tests.server_harness import iris_server
from tests.test_server_e2e import IDLE
from tests.video_clips import make_clip, video_data_url, video_part
from tests.worker_harness import worker_factory

torch.set_num_threads(2)
MAX_NEW = 6
RATE = 0.5
CLIP = make_clip(12, width=128, height=96)
FPS = 10.0  # every frame of the clip: 6 temporal patches


def messages(question: str, url: str) -> list[dict]:
    content = [video_part(url), {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def worker_prompt(model_dir: Path, question: str, run_dir: Path, rate: float) -> PromptInput:
    """The token ids and temporal patches an in-process worker makes of the question."""
    builder = PromptBuilder(model_dir)
    with worker_factory(builder, f"test-{uuid.uuid4().hex[:12]}", run_dir) as make:
        worker = make(video_pruning_rate=rate)
        request = TokenizeRequest(
            "ref", Sampling(), messages=messages(question, video_data_url(CLIP)), fps=FPS
        )
        out = worker.handle(request)
        assert isinstance(out, EngineRequest), out
        with ShmReader() as reader:
            pixels = [reader.view(ref.pixels).clone() for ref in out.images if ref.pixels]
        worker.unpin(out)
    assert len(pixels) == len(out.images) and all(ref.frames == 2 for ref in out.images)
    return PromptInput(Prompt(unpack_token_ids(out.token_ids), list(out.images)), pixels)


def reference(model_dir: Path, prompt: PromptInput, max_new: int) -> list[int]:
    """Greedy tokens of transformers' model on the pruned video (see the module's doc)."""
    model = hf_model(str(model_dir))
    inner = model.model
    images = prompt.images
    rows = hf_video_pixel_values(model_dir, prompt.pixels, images)
    grids = torch.tensor([image.grid_thw for image in images])
    with torch.inference_mode():
        features = inner.get_video_features(rows, grids, return_dict=True)

    def kept_rows(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        chosen = zip(parts, images, strict=True)
        return torch.cat([p if i.kept is None else p[list(i.kept)] for p, i in chosen])

    video = kept_rows(features.pooler_output)
    deepstack = [kept_rows(level) for level in getattr(features, "deepstack_features", [])]
    prompt_len = len(prompt.token_ids)
    positions, delta = prompt_positions(prompt_len, images)
    ids = list(prompt.token_ids)
    for _ in range(max_new):
        visual = torch.zeros(len(ids), dtype=torch.bool)
        for image in images:
            visual[image.offset : image.end] = True
        later = (torch.arange(prompt_len, len(ids)) + delta).repeat(3, 1)
        with torch.inference_mode():
            embeds = inner.get_input_embeddings()(torch.tensor([ids]))
            embeds[0, visual] = video
            extra = {}
            if deepstack:
                extra = {"visual_pos_masks": visual[None], "deepstack_visual_embeds": deepstack}
            hidden = inner.language_model(
                inputs_embeds=embeds,
                position_ids=torch.cat([positions, later], 1)[:, None],
                **extra,
            ).last_hidden_state
            ids.append(int(model.lm_head(hidden[0, -1]).argmax()))
    return ids[prompt_len:]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


def test_the_reference_is_transformers_own_without_pruning(
    qwen2_5_vl_tiny, qwen3_vl_tiny, tmp_path
):
    """Qwen3-VL: `generate`. Qwen2.5-VL: the first token of a forward given Iris's
    positions, since transformers 5.24 places the text after its video elsewhere
    (tests/test_video_engine.py does the same)."""
    prompt = worker_prompt(qwen3_vl_tiny, "What happens?", tmp_path, 0.0)
    assert reference(qwen3_vl_tiny, prompt, MAX_NEW) == hf_generate(qwen3_vl_tiny, prompt, MAX_NEW)
    prompt = worker_prompt(qwen2_5_vl_tiny, "What happens?", tmp_path, 0.0)
    logits = hf_video_block_logits(qwen2_5_vl_tiny, prompt)
    assert reference(qwen2_5_vl_tiny, prompt, 1) == [int(logits.argmax())]


@pytest.mark.parametrize("budget", [16, 2048])
def test_a_pruned_video_gives_the_reference_tokens(model_dir, tmp_path, budget):
    prompt = worker_prompt(model_dir, "What happens?", tmp_path, RATE)
    assert any(image.kept is not None for image in prompt.images)
    iris = cpu_engine(model_dir, max_num_batched_tokens=budget)  # 16: chunks cut patches
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW)
    assert iris.generate([prompt], greedy) == [reference(model_dir, prompt, MAX_NEW)]
    assert iris.stats().images_encoded == len(prompt.images)


def test_pruned_and_unpruned_patches_share_the_engine_and_its_caches(qwen3_vl_tiny, tmp_path):
    """The first patch keeps its key under pruning; later ones go by keys of their own."""
    pruned = worker_prompt(qwen3_vl_tiny, "What happens?", tmp_path, RATE)
    whole = worker_prompt(qwen3_vl_tiny, "What happens?", tmp_path, 0.0)
    iris = cpu_engine(qwen3_vl_tiny)
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW)
    iris.generate([whole], greedy)
    encoded = iris.stats().images_encoded
    [tokens] = iris.generate([pruned], greedy)
    assert iris.stats().images_encoded == encoded + len(pruned.images) - 1
    assert tokens == reference(qwen3_vl_tiny, pruned, MAX_NEW)


# --- over HTTP -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen3_vl_tiny, tmp_path_factory):
    with iris_server(
        qwen3_vl_tiny,
        "--served-model-name", "tiny",
        "--max-model-len", "2048",
        "--video-pruning-rate", str(RATE),
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


def ask(server, question: str) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": messages(question, video_data_url(CLIP)),
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "mm_processor_kwargs": {"fps": FPS},
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def test_a_served_pruned_video_and_a_second_question_about_it(server, qwen3_vl_tiny, tmp_path):
    first = ask(server, "What happens?")
    assert first.status_code == 200, first.text
    prompt = worker_prompt(qwen3_vl_tiny, "What happens?", tmp_path, RATE)
    assert first.json()["usage"]["prompt_tokens"] == len(prompt.token_ids)
    expected = reference(qwen3_vl_tiny, prompt, MAX_NEW)
    text = PromptBuilder(qwen3_vl_tiny).tokenizer.decode(expected, skip_special_tokens=True)
    assert first.json()["choices"][0]["message"]["content"] == text
    server.wait_for_metrics(IDLE)
    encoded = server.metrics()["iris_mm_images_encoded_total"]
    assert encoded == len(prompt.images)

    second = ask(server, "And at the end?")
    assert second.status_code == 200, second.text
    server.wait_for_metrics(IDLE)
    assert server.metrics()["iris_mm_images_encoded_total"] == encoded  # no patch again
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt.images[-1].end // 16 * 16  # the pages up to the video's last
