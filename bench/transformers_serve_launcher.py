"""Stock `transformers serve` with one swap: the Qwen-VL processor of a local folder.

    python -m bench.transformers_serve_launcher MODEL_DIR --port 8001 --device cpu [...]

Every argument goes to transformers' own CLI (`transformers serve --help`), unchanged.

Why the swap: `transformers serve` builds a model's processor with `AutoProcessor`, and
for the Qwen-VL models that also builds the video processor, which needs torchvision;
with the CPU torch wheel there is none, so the stock CLI fails at start-up with
"Qwen2VLVideoProcessor requires the Torchvision library". This launcher replaces only
the processor loader (`ModelLoader.load_processor` in transformers 5.25 and later, which
takes one model id `repo[@revision][:file.gguf]`; `ModelManager._load_processor` in earlier
5.x releases), and only for a local folder of an architecture `reference_processor` knows
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), by `tiny_checkpoint.reference_processor`:
transformers' own processor class, built from the folder's tokenizer and its (PIL) image
processor, with no video processor.
Chat template, image loading, resizing, normalisation, the model, `generate`, batching
(none for images: one VLM request at a time) and the HTTP layer are all stock.

The swap is made on import: in 5.25 and later the model runs in a spawned process, which
imports this module again (as its main module) but does not call `main`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers.cli.serving import model_manager

from iris_serve.common.architectures import by_model_type
from iris_serve.tiny_checkpoint import reference_processor

# (the class that loads a model's processor, the method's name), by transformers version
_LOADER, _METHOD = (
    (model_manager.ModelLoader, "load_processor")
    if hasattr(model_manager, "ModelLoader")
    else (model_manager.ModelManager, "_load_processor")
)
_stock_load_processor = getattr(_LOADER, _METHOD)


def _is_local_qwen_vl(model_id: str) -> bool:
    config = Path(model_id) / "config.json"
    if not config.is_file():
        return False
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type", "")
    return by_model_type(model_type) is not None


def _load_processor(self: object, model_id: str, *args: object, **kwargs: object) -> object:
    """A local Qwen-VL folder's reference processor; the stock loader's for anything else
    (a hub id, a revision, a GGUF file)."""
    folder = model_id if Path(model_id).exists() else model_id.split("@", 1)[0]  # `@revision`
    if not args and kwargs.get("gguf_file") is None and _is_local_qwen_vl(folder):
        return reference_processor(folder)
    return _stock_load_processor(self, model_id, *args, **kwargs)


setattr(_LOADER, _METHOD, _load_processor)  # the one swap; see the module docstring


def main(argv: list[str] | None = None) -> None:
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", "serve", *(sys.argv[1:] if argv is None else argv)]
    transformers_cli()


if __name__ == "__main__":
    main()
