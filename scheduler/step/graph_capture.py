"""Capturing a rank's decode graphs at start-up (`decode_graphs.DecodeGraphs`), and what
happens when capture fails: one device decodes eagerly, a tensor-parallel rank stops. A
model that reads values back to the host in its decode step is not captured at all."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..attention import AttentionBackend
from ..config import EngineConfig
from ..hybrid.linear_state import LinearStates
from ..models.moe import RoutedExperts
from ..models.tensor_parallel import TPShard
from .decode_graphs import CudaGraphCapture, DecodeGraphs

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM

logger = logging.getLogger(__name__)


def capture_decode_graphs(
    model: Qwen2VLForCausalLM,
    attention: AttentionBackend,
    device: torch.device,
    config: EngineConfig,
    max_model_len: int,
    tp: TPShard,
    linear_states: LinearStates | None = None,
) -> DecodeGraphs | None:
    """The decode graphs. Where capture fails on one device the server decodes eagerly
    and says why (a capture error leaves the device usable). Under tensor parallelism it
    stops instead, naming `--enforce-eager`: the other ranks go on capturing, inside
    collectives this rank would never join, and the launcher stops them all."""
    uncapturable = why_decode_is_not_capturable(model)
    if uncapturable is not None:
        logger.warning("decode steps run eagerly, without CUDA graphs: %s", uncapturable)
        return None
    max_pages = -(-max_model_len // config.page_size)
    reserved = torch.cuda.memory_reserved(device)
    try:
        with torch.inference_mode():
            graphs = DecodeGraphs.build(
                model,
                attention,
                device,
                config.max_num_seqs,
                max_pages,
                CudaGraphCapture(device),
                linear_states,
            )
    except RuntimeError as error:
        if tp.size > 1:
            raise RuntimeError(
                f"capturing CUDA graphs for decode failed on rank {tp.rank} ({error}); "
                "--enforce-eager runs without them"
            ) from error
        logger.exception(
            "capturing CUDA graphs for decode failed: decode steps run eagerly "
            "(--enforce-eager skips the capture)"
        )
        torch.cuda.synchronize(device)
        return None
    if graphs is not None:
        logger.info(
            "decode graphs hold %.2f GiB of GPU memory (within the headroom)",
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )
    return graphs


def why_decode_is_not_capturable(model: Qwen2VLForCausalLM) -> str | None:
    """Why no CUDA graph can record `model`'s decode step (None: nothing known stops it);
    every rank holds the same layers, so all ranks agree."""
    per_expert = [m for m in model.modules() if isinstance(m, RoutedExperts) and m.per_expert]
    if per_expert:
        return (
            f"the routed experts of {len(per_expert)} layers are held in "
            f"{per_expert[0].quantization}, one expert at a time, reading the token counts "
            "back to the host"
        )
    return None
