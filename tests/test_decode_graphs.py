"""Decode steps replayed from fixed buffers (`scheduler/step/decode_graphs.py`) give the tokens
of eager steps, and a decode step holds nothing a CUDA graph cannot record.

There is no CUDA here: the graphs are "captured" with `eager_replay`, which reruns the
recorded closure over the same fixed buffers — the ids, positions, attention metadata
and output a real graph would read and write — so everything but the recording itself
is under test, with the triton backend under Triton's interpreter (`kernels` fixture).
`pytest -m gpu` (tests/test_gpu.py) captures real graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Prompt, Sampling
from iris_serve.scheduler.step.decode_graphs import (
    MAX_CAPTURE_SIZE,
    CapturedStep,
    DecodeGraphs,
    capture_sizes,
    eager_replay,
)
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)
CPU = torch.device("cpu")
PAGE = 4

# Ops that make the host wait for the device (or copy host data to it) on CUDA: inside a
# capture each is an error, or a value frozen into the graph.
HOST_SYNCING_OPS = {
    "aten::item": ".item(), bool() or int() of a tensor",
    "aten::_local_scalar_dense": ".item(), bool() or int() of a tensor",
    "Tensor.tolist": "copies the tensor to the host (not an aten op: seen by a patch)",
    "aten::nonzero": "a data-dependent shape (also boolean-mask indexing)",
    "aten::masked_select": "a data-dependent shape",
    "aten::unique_dim": "a data-dependent shape",
    "aten::_unique2": "a data-dependent shape",
    "aten::unique_consecutive": "a data-dependent shape",
    "aten::bincount": "reads the largest value to size its output",
    "aten::repeat_interleave": "reads the repeats to size its output",
    "aten::equal": "returns a host bool",
    "aten::is_nonzero": "returns a host bool",
    "aten::lift_fresh": "torch.tensor(host data): a host-to-device copy",
}


def test_the_ladder_has_a_graph_for_every_batch_the_scheduler_forms():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    large = capture_sizes(10_000)
    assert large[-1] == MAX_CAPTURE_SIZE and large == sorted(set(large)) and len(large) <= 51


def with_graphs(engine: Engine, capture: Callable = eager_replay) -> DecodeGraphs:
    """Gives `engine`'s runner decode graphs, as `DeviceState.build` does on CUDA."""
    max_pages = -(-engine.max_model_len // engine.config.page_size)
    graphs = DecodeGraphs.build(
        engine.model,
        engine.attention,
        CPU,
        engine.config.max_num_seqs,
        max_pages,
        capture,
        engine.runner.linear_states,
    )
    assert graphs is not None
    engine.runner.decode_graphs = graphs
    return graphs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_5"])
def test_replayed_decode_steps_give_the_eager_tokens(kernels, tiny_checkpoint, arch):
    """Three requests, one with an image (its decode positions are offset by the image's
    rope delta), prefilled in one step and finishing at different steps: the batch runs the
    graphs of 4 (padded from 3), 2 and 1. Greedy tokens equal eager `sdpa` steps'. On the
    hybrid model the linear layers' slots come from the graph's fixed buffer, padding rows
    use the scratch slot, and the snapshots decode steps take (every `PAGE` tokens) are
    copied after the replay; the same prompts again then resume from those snapshots."""
    model_dir = tiny_checkpoint(arch)
    builder = PromptBuilder(str(model_dir))
    prompts = [
        chat_prompt(builder, "describe the picture", [make_image(64, 48)]),
        chat_prompt(builder, "count to twenty: one two three four five six seven"),
        chat_prompt(builder, "hello"),
    ]
    samplings = [Sampling(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 4, 2)]
    reference = cpu_engine(model_dir, page_size=PAGE)
    eager = reference.generate(prompts, samplings)

    engine = cpu_engine(
        model_dir,
        attention_backend="triton",
        page_size=PAGE,
        max_num_seqs=8,
        mm_encoder_placement="inline",  # all three prefill in the first step, whatever the timing
    )
    graphs = with_graphs(engine)
    assert graphs.sizes == [1, 2, 4, 8]
    assert engine.generate(prompts, samplings) == eager
    assert graphs.replays[4] >= 1 and graphs.replays[2] >= 1 and graphs.replays[1] >= 1
    assert sum(graphs.replays.values()) == 7 - 1  # every decode step, no prefill step
    if engine.state_slots is not None:  # the next turn resumes past the prompt: a decode's
        first = prompts[0]
        turn = PromptInput(
            Prompt(first.token_ids + eager[0] + first.token_ids[-4:], first.images), first.pixels
        )
        engine.add_request("next-turn", turn, samplings[1])
        outputs = list(engine.run_until_idle())
        assert outputs[0].cached_tokens > len(first.token_ids)
        assert [o.new_token_ids[0] for o in outputs] == reference.generate([turn], samplings[1])[0]
    engine.close()


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_a_decode_step_holds_nothing_a_cuda_graph_cannot_record(
    kernels, each_arch_dir, monkeypatch
):
    """Every op of every architecture's recorded step (MoE routing included), at the
    sizes of a small ladder: none syncs the host."""
    recorder = OpRecorder()
    tolist = torch.Tensor.tolist

    def recorded_tolist(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
        recorder.seen.add("Tensor.tolist")
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)

    def recording(step: Callable[[], torch.Tensor]) -> CapturedStep:
        step()  # the warm-up `CudaGraphCapture` runs before it records: caches fill here
        with recorder:
            output = step()
        return CapturedStep(output, lambda: None)

    engine = cpu_engine(each_arch_dir, attention_backend="triton", page_size=PAGE, max_num_seqs=2)
    with torch.inference_mode():
        with_graphs(engine, recording)
    engine.close()
    linears = {"aten::linear", "mkldnn::_linear_pointwise"}  # PyTorch's or oneDNN's
    assert linears & recorder.seen  # the step ran, and was seen
    syncing = {op: why for op, why in HOST_SYNCING_OPS.items() if op in recorder.seen}
    assert not syncing, f"a decode step syncs the host: {syncing}"


def test_a_backend_that_plans_on_the_host_runs_decode_eagerly(qwen2_vl_tiny):
    engine = cpu_engine(qwen2_vl_tiny, attention_backend="sdpa")
    assert DecodeGraphs.build(engine.model, engine.attention, CPU, 4, 8, eager_replay) is None
    engine.close()


def test_a_failed_capture_decodes_eagerly_alone_and_stops_tensor_parallel_ranks(monkeypatch):
    """`DeviceState`'s capture on CUDA (the calls to the CUDA runtime stubbed): one device
    goes on without graphs; a rank of a tensor-parallel group raises, naming the flag,
    since its peers would wait for it inside their captures' collectives."""
    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.models.tensor_parallel import SINGLE, TPShard
    from iris_serve.scheduler.step import graph_capture

    def failing_build(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "build", failing_build)
    monkeypatch.setattr(graph_capture, "CudaGraphCapture", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    config = EngineConfig(model="m")
    capture = graph_capture.capture_decode_graphs
    model = torch.nn.Module()  # nothing in it known to stop a capture
    assert capture(model, None, CPU, config, 64, SINGLE) is None  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"rank 1 .*--enforce-eager"):
        capture(model, None, CPU, config, 64, TPShard(1, 2))  # type: ignore[arg-type]
