"""Capturing a rank's decode graphs at start-up (`decode_graphs.DecodeGraphs`), and what
happens when capture fails: one device decodes eagerly, a tensor-parallel rank stops."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..attention import AttentionBackend
from ..config import EngineConfig
from ..hybrid.linear_state import LinearStates
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
