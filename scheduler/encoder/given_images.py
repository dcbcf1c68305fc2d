"""Images a request brings without pixels to encode: the client's own embeddings
(`image_embeds`), or a uuid whose pixels the worker evicted, served from the embedding
cache. Both are taken (or refused) as the request is admitted, so a refusal is a 400
for that request and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..step.request import Request
from .manager import EncoderManager

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM


class RefusedImage(ValueError):
    """An image the engine cannot take (a 400 naming the content part, when the worker
    said which): it came without pixels and its embedding is not cached (the client must
    send its data again), or the client's embeddings do not fit the model."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def hold_given_images(
    request: Request,
    pixels: Sequence[torch.Tensor | None],
    encoder: EncoderManager,
    model: Qwen2VLForCausalLM,
) -> None:
    """Takes every image given by its embeddings into the embedding cache and holds the
    cached embedding of every image that came without pixels; raises `RefusedImage`
    (the caller then releases what the request holds)."""
    for index, image_pixels in enumerate(pixels):
        if request.images[index].embeds:
            _take_embeds(request, index, image_pixels, encoder, model)
            continue
        if image_pixels is not None or encoder.hold_cached(request, index):
            continue
        report = request.image_reports[index] if request.image_reports else None
        where = report.part if report else f"image {index + 1}"
        named = f" with uuid {report.uuid!r}" if report and report.uuid else ""
        raise RefusedImage(
            f"{where}: the image{named} is no longer cached (neither its pixels nor its "
            "embedding): send it again with its data and the same uuid",
            report.part if report else None,
        )


def _take_embeds(
    request: Request,
    index: int,
    given: torch.Tensor | None,
    encoder: EncoderManager,
    model: Qwen2VLForCausalLM,
) -> None:
    """A client's embeddings of image `index`, checked against this model: one row per
    image token, and the vision tower's width (hidden size x (1 + DeepStack levels))."""
    config = model.config
    width = config.hidden_size * (1 + config.deepstack_levels)
    expected = (request.images[index].length, width)
    if given is None or tuple(given.shape) != expected or not given.is_floating_point():
        report = request.image_reports[index] if request.image_reports else None
        shape = "none" if given is None else f"{list(given.shape)} {given.dtype}"
        raise RefusedImage(
            f"{report.part if report else f'image {index + 1}'}: image_embeds of shape "
            f"{shape} do not fit this model: {list(expected)} expected (one row per image "
            f"token; hidden size {config.hidden_size} x (1 + {config.deepstack_levels} "
            "DeepStack levels))",
            report.part if report else None,
        )
    # a copy in any case: `given` is a view of the worker's arena, released next
    embedding = given.to(device=model.device, dtype=model.dtype, copy=True)
    encoder.hold_given(request, index, embedding)
