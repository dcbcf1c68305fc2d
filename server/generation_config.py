"""The model's own sampling defaults, applied as vLLM applies them.

A checkpoint's `generation_config.json` says how its authors sample it (Qwen3-VL:
temperature 0.7, top_k 20, top_p 0.8). vLLM makes them the defaults of every request
field left unset (`--generation-config auto`, its default); without them a real Qwen
checkpoint samples differently from vLLM and transformers. `--generation-config vllm`
ignores the file (the OpenAI defaults); `--generation-config DIR` reads
`DIR/generation_config.json` instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("iris.server")

# generation_config.json key -> the request field it is the default of
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}  # max_new_tokens is left out: Iris's default answer length is the rest of the context


def sampling_defaults(setting: str, model_path: str | Path) -> dict[str, Any]:
    """The request-field defaults `--generation-config setting` gives for this model."""
    if setting == "vllm":
        return {}
    folder = Path(model_path) if setting == "auto" else Path(setting).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise FileNotFoundError(f"--generation-config {setting}: no {path}")
        return {}
    raw = json.loads(path.read_text(encoding="utf-8"))
    defaults = {field: raw[key] for key, field in _FIELDS.items() if raw.get(key) is not None}
    if defaults:
        logger.info(
            "sampling defaults from %s (a request's own fields win; "
            "--generation-config vllm ignores them): %s",
            path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults
