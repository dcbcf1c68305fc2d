"""Hugging Face transformers as the reference: same checkpoint, same inputs, `generate`."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import ImageRef, Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.models.loader import iter_checkpoint
from iris_serve.scheduler.models.mrope import mrope_positions
from iris_serve.scheduler.step.engine import Engine


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


@functools.lru_cache(maxsize=4)
def hf_image_processor(model_dir: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir, backend="pil")


def hf_pixel_values(model_dir: str | Path, pixels: torch.Tensor) -> torch.Tensor:
    """The processor's `pixel_values` of a resized uint8 image [H, W, 3], made by the
    processor's own rescale, normalize and patchify (what it does after resizing)."""
    processor = hf_image_processor(str(model_dir))
    image = np.moveaxis(pixels.numpy(), -1, 0)  # [C, H, W], as the processor holds it
    values = processor.rescale(image, processor.rescale_factor)
    values = processor.normalize(values, processor.image_mean, processor.image_std)
    rows, _, _ = processor.patchify(
        values, processor.patch_size, processor.merge_size, processor.temporal_patch_size
    )
    return torch.from_numpy(np.ascontiguousarray(rows))


def hf_prompt_pixel_values(model_dir: str | Path, prompt: PromptInput) -> torch.Tensor:
    """The processor's `pixel_values` of all of a prompt's images, concatenated."""
    return torch.cat([hf_pixel_values(model_dir, pixels) for pixels in prompt.pixels])


def hf_generate(model_dir: str | Path, prompt: PromptInput, max_new_tokens: int) -> list[int]:
    """Greedy `generate` on exactly the engine's token ids and pixels (the processor's
    `pixel_values` of the same resized images)."""
    return hf_generate_with_margins(model_dir, prompt, max_new_tokens)[0]


def hf_generate_with_margins(
    model_dir: str | Path,
    prompt: PromptInput,
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[int], list[float]]:
    """`hf_generate` in `dtype`, with each step's margin: its top logit minus the next."""
    model = hf_model(str(model_dir), dtype)
    input_ids = torch.tensor([prompt.token_ids])
    inputs: dict[str, torch.Tensor] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
    }
    images = [i for i, image in enumerate(prompt.images) if image.frames == 1]
    patches = [i for i, image in enumerate(prompt.images) if image.frames > 1]
    if images:
        inputs["pixel_values"] = torch.cat(
            [hf_pixel_values(model_dir, prompt.pixels[i]) for i in images]
        ).to(dtype)
        inputs["image_grid_thw"] = torch.tensor([prompt.images[i].grid_thw for i in images])
    if patches:  # each temporal patch a video of its own: Qwen3-VL's blocks (see below)
        inputs["pixel_values_videos"] = hf_video_pixel_values(
            model_dir, [prompt.pixels[i] for i in patches], [prompt.images[i] for i in patches]
        )
        inputs["video_grid_thw"] = torch.tensor([prompt.images[i].grid_thw for i in patches])
    if prompt.images:  # (a random model's answer may hold a pad token: only a prompt's count)
        config = model.config
        is_video = (input_ids == config.video_token_id) & bool(patches)
        inputs["mm_token_type_ids"] = (input_ids == config.image_token_id).int() + 2 * is_video
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = [torch.topk(step[0].float(), 2).values for step in output.logits]
    margins = [float(values[0] - values[1]) for values in top2]
    return output.sequences[0, input_ids.shape[1] :].tolist(), margins


def hf_video_pixel_values(
    model_dir: str | Path, pixels: Sequence[torch.Tensor], images
) -> torch.Tensor:
    """`pixel_values_videos` of video temporal patches (uint8 `[T, H, W, 3]` each): the
    video processor's rows, which `PatchMaker` reproduces (tests/test_patches.py holds it
    to transformers' layout; transformers' video processor itself needs torchvision).
    Each patch is one video `(1, h, w)`: the ViT attends within a temporal patch, so that
    equals one video of them all; Qwen3-VL splits a video into such blocks anyway."""
    from iris_serve.scheduler.encoder.patches import PatchMaker

    maker = PatchMaker.from_checkpoint(model_dir, torch.device("cpu"), torch.float32)
    return maker(list(pixels), [image.grid_thw for image in images])


def prompt_positions(num_tokens: int, images: Sequence[ImageRef]) -> tuple[torch.Tensor, int]:
    """Iris's M-RoPE positions and rope delta of a prompt of `num_tokens` with these items
    (merge size 2, as every tiny checkpoint has), as `Engine.add_request` computes them."""
    return mrope_positions(
        num_tokens,
        [(i.offset, i.length) for i in images],
        [i.grid_thw for i in images],
        2,
        [(i.rope_time, i.continue_block) for i in images],
        [i.kept for i in images],
    )


def hf_video_block_logits(model_dir: str | Path, prompt: PromptInput) -> torch.Tensor:
    """transformers' last-token logits of a Qwen2/2.5-VL prompt whose items are one
    video's temporal patches, one block, at Iris's positions (transformers 5.24 places
    the text after a video elsewhere: tests/test_video_positions.py)."""
    images = prompt.images
    positions, _ = prompt_positions(len(prompt.token_ids), images)
    model = hf_model(str(model_dir))
    input_ids = torch.tensor([prompt.token_ids])
    with torch.inference_mode():
        return model(
            input_ids=input_ids,
            position_ids=positions[:, None],
            pixel_values_videos=hf_video_pixel_values(model_dir, prompt.pixels, images),
            video_grid_thw=torch.tensor([[len(images), *images[0].grid_thw[1:]]]),
            mm_token_type_ids=2 * (input_ids == model.config.video_token_id).int(),
        ).logits[0, -1]


def make_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A deterministic, structured test image (gradients plus noise) in any PIL mode."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256], axis=-1
    )
    noise = rng.integers(0, 64, size=(height, width, 3))
    rgb = Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")
    if mode == "P":
        return rgb.quantize(colors=32)
    return rgb.convert(mode)


def cpu_engine(model_dir: str | Path, **overrides) -> Engine:
    """An fp32 CPU engine (unless `dtype` says otherwise); 16 MiB of KV (32k tiny-model tokens) unless told otherwise,
    since zero-filling the default 1 GiB per engine dominates a test's time. Prefill is
    not paced (`max_itl_stretch` 0) unless told: the latency budget sizes chunks from
    measured step times, so plans (chunks, preemptions) would depend on the machine's
    speed; its own tests turn it on (test_latency_budget.py)."""
    overrides.setdefault("kv_cache_memory", 16 << 20)
    overrides.setdefault("max_itl_stretch", 0)
    overrides.setdefault("dtype", "float32")
    return Engine(EngineConfig(model=str(model_dir), device="cpu", **overrides))


def numbered_prompts(
    builder, count: int, words_per_step: int, image_every: int, seed: int
) -> list[PromptInput]:
    """`count` chat prompts growing by `words_per_step` numbers each; every
    `image_every`-th one carries an image of growing size."""
    return [
        chat_prompt(
            builder,
            "tell me about number " + " ".join(str(j) for j in range(i * words_per_step)),
            [make_image(60 + 20 * i, 50 + 10 * i, seed=seed + i)] if i % image_every == 0 else [],
        )
        for i in range(count)
    ]


def generate_joining_one_per_step(
    engine: Engine, prompts: list[PromptInput], sampling: Sampling
) -> list[list[int]]:
    """Runs `prompts` with one new request added per step, joining whatever is running
    (mid-prefill or decoding); returns each prompt's tokens."""
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, sampling)
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def chat_prompt(builder, text: str, images=()) -> PromptInput:
    """One user turn: the images first, then the text, through the chat template."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return builder.build(builder.render_chat([{"role": "user", "content": content}]), images)


_HF_OUTPUTS: dict[tuple, list[int]] = {}


def reference_tokens(model_dir: str | Path, prompt: PromptInput, max_new: int) -> list[int]:
    """`hf_generate`, memoised: several tests and scenarios ask about the same prompt."""
    key = (str(model_dir), tuple(prompt.token_ids), tuple(im.key for im in prompt.images), max_new)
    if key not in _HF_OUTPUTS:
        _HF_OUTPUTS[key] = hf_generate(model_dir, prompt, max_new)
    return _HF_OUTPUTS[key]


def assert_parity(
    model_dir: str | Path, prompts: list[PromptInput], outputs: list[list[int]], max_new: int
) -> None:
    """Each output equals transformers' greedy `generate` on the same prompt."""
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        expected = reference_tokens(model_dir, prompt, max_new)
        assert got == expected, f"prompt {i}: Iris {got} != transformers {expected}"


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` for every tensor of the checkpoint, on the CPU, as stored."""
    for name, tensor in iter_checkpoint(model_dir):
        yield name, tensor.load()


class SingleSequenceAttention:
    """No cache: full causal attention over the tokens given, for the model tests.

    By default all N tokens are one sequence. `seq_lens` splits the flat batch into
    several independent sequences (each causal over itself only).
    """

    def __init__(self, seq_lens: Sequence[int] | None = None) -> None:
        self.seq_lens = list(seq_lens) if seq_lens is not None else None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.seq_lens is None:
            return _causal(q, k, v)
        if sum(self.seq_lens) != q.shape[0]:
            raise ValueError(f"seq_lens sum to {sum(self.seq_lens)}, got {q.shape[0]} tokens")
        parts = zip(
            q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens), strict=True
        )
        return torch.cat([_causal(*part) for part in parts])


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [N, heads, D] -> [1, heads, N, D]: the fused SDPA kernels take 4-D inputs only
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, scale=q.shape[-1] ** -0.5, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out[0].transpose(0, 1)
