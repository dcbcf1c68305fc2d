"""`--cpu-linear onednn` (the default on a CPU): every linear layer computes through oneDNN
with a prepacked weight and gives what PyTorch's own linear gives, to float rounding; the
dense weight stays readable; `--cpu-linear aten` leaves the layers alone, and both give
the same greedy tokens (parity with transformers runs on the default everywhere else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.models.cpu_linear import pack_linears
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_computes_what_pytorchs_linear_does(dtype):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(64, 96), nn.Linear(96, 32, bias=False)]).to(dtype)
    dense = [(layer.weight.detach().clone(), layer.bias) for layer in layers]
    assert pack_linears(layers) == 2
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in ([1, 64], [7, 64], [2, 5, 64], [0, 64]):  # decode, prefill, batched, empty
        x = torch.randn(*rows, dtype=dtype)
        y = layers[1](layers[0](x))
        (w0, b0), (w1, _) = dense
        expected = F.linear(F.linear(x, w0, b0), w1)
        assert y.shape == expected.shape
        torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(layers[0].weight, dense[0][0])  # the dense weight is still there


def test_the_engine_packs_by_default_and_aten_gives_the_same_tokens(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2_5_vl")
    prompt = chat_prompt(PromptBuilder(model_dir), "Describe.", [make_image(84, 56, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=8)
    engines = {kind: cpu_engine(model_dir, cpu_linear=kind) for kind in ("onednn", "aten")}
    packed = {
        kind: sum(hasattr(m, "packed_weight") for m in engine.model.modules())
        for kind, engine in engines.items()
    }
    assert packed["onednn"] > 0 and packed["aten"] == 0
    tokens = {kind: engine.generate([prompt], greedy) for kind, engine in engines.items()}
    assert tokens["onednn"] == tokens["aten"]
