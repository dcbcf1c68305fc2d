"""The architecture table (`common/architectures.py`) is the only table keyed by architecture.

(a) No other product module keys a table or a branch on an architecture's name: a scan of
the source with `ast` finds every string naming one (a row's `name` or `model_type`, or
any transformers-style `...ForConditionalGeneration`) where it keys something (a dict
key, a set/tuple/list element, a comparison, a subscript, a `.get`/`.startswith`
argument, a `case`) or is named as a constant, outside the table and the few files listed in `ALLOWED` with why.
(b) A new row is all a new architecture needs: a fake one, reusing Qwen3-VL's model class
under a new name, is picked up by the scheduler's registry and config reader and by the
worker's video rules with no other edit.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from iris_serve.common import architectures
from iris_serve.common.architectures import ARCHITECTURES, Architecture

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("common", "ipc", "launch", "server", "tokenizer_worker", "scheduler", "tiny_checkpoint")
TABLE = Path("common/architectures.py")
# Files that must name architectures, and why. An entry that names none fails, so the
# list stays true.
ALLOWED = {
    Path("tiny_checkpoint/known_configs.py"): (
        "verbatim copies of published config.json files, which name their architecture"
    ),
}
_HF_CLASS = re.compile(r"^[A-Z]\w*ForConditionalGeneration$")


def is_architecture_name(value: object) -> bool:
    """Whether `value` names an architecture: a row's `name` or `model_type`, or a string
    shaped like a transformers VLM class (a new architecture not yet in the table)."""
    if not isinstance(value, str):
        return False
    known = {name for row in ARCHITECTURES.values() for name in (row.name, row.model_type)}
    return value in known or bool(_HF_CLASS.match(value))


def _keys(node: ast.AST) -> list[ast.expr]:
    """The expressions `node` keys something by, if it is a table or a branch."""
    if isinstance(node, ast.Dict):
        return [key for key in node.keys if key is not None]
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return list(node.elts)
    if isinstance(node, ast.Compare):
        return [node.left, *node.comparators]
    if isinstance(node, ast.Subscript):
        return [node.slice]
    if isinstance(node, ast.MatchValue):
        return [node.value]
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        return [node.value]  # a named constant for an architecture, to key tables with
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("get", "startswith", "endswith", "removeprefix", "removesuffix")
    ):
        return list(node.args[:1])
    return []


def architecture_keys(source: str) -> list[tuple[int, str]]:
    """(line, name) of every architecture name in `source` that keys a table or a branch."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        for key in _keys(node):
            if isinstance(key, ast.Constant) and is_architecture_name(key.value):
                found.add((key.lineno, key.value))
    return sorted(found)


def product_files() -> list[Path]:
    return sorted(path.relative_to(REPO) for p in PRODUCT for path in (REPO / p).rglob("*.py"))


def test_no_table_keyed_by_architecture_outside_the_table():
    problems = []
    for path in product_files():
        if path == TABLE or path in ALLOWED:
            continue
        for line, name in architecture_keys((REPO / path).read_text(encoding="utf-8")):
            problems.append(
                f"{path}:{line}: keyed by the architecture {name!r}; make it a field of the "
                f"rows in {TABLE} and branch on the field"
            )
    assert not problems, "\n".join(problems)


def test_every_allowance_still_names_an_architecture():
    for path in ALLOWED:
        assert architecture_keys((REPO / path).read_text(encoding="utf-8")), path


@pytest.mark.parametrize(
    "source",
    [
        'CLASSES = {"qwen2_vl": 1, "qwen3_vl": 2}',
        'NESTED = ("qwen3_vl", "qwen3_5")',
        'if model_type == "qwen2_5_vl":\n    pass\nelif model_type in {"qwen3_vl_moe"}:\n    pass',
        'x = arch in ["Qwen3_5MoeForConditionalGeneration"]',
        'first = 248044 if model_type.startswith("qwen3_5") else 151643',
        'DEFAULTS["qwen2_5_vl"] = DEFAULTS["qwen2_vl"]',
        'family = FAMILIES.get("qwen3_vl")',
        'match arch:\n    case "Qwen2VLForConditionalGeneration":\n        pass',
        'NEW = {"Qwen9VLForConditionalGeneration": "m:C"}',  # not in the table yet
        'QWEN2_VL = "Qwen2VLForConditionalGeneration"\nHYBRID = (QWEN2_VL,)',
    ],
)
def test_a_planted_table_is_found(source: str):
    assert architecture_keys(source)


def test_names_in_prose_and_facts_are_not_tables():
    source = (
        '"""Qwen2VLForConditionalGeneration and qwen3_vl, in a docstring."""\n'
        'if row.tower == "qwen2.5" and row.experts in ("routed", "routed_shared"):\n'
        '    raise ValueError(f"{name} is not qwen3_vl")\n'
    )
    assert architecture_keys(source) == []


def test_each_row_is_consistent():
    import transformers

    from iris_serve.scheduler.models.qwen2_vl import Qwen2VLForCausalLM
    from iris_serve.scheduler.models.registry import model_class

    assert len({row.model_type for row in ARCHITECTURES.values()}) == len(ARCHITECTURES)
    for name, row in ARCHITECTURES.items():
        assert row.name == name
        hf = getattr(transformers, row.name)
        assert hf.config_class.model_type == row.model_type
        assert issubclass(getattr(transformers, row.processor), transformers.ProcessorMixin)
        assert issubclass(model_class(name), Qwen2VLForCausalLM)
        assert not (row.hybrid or row.experts) or row.decoder == "qwen3"
        assert not row.deepstack or row.tower == "qwen3"


# --- (b) a new architecture is one row ----------------------------------------------------

FAKE = Architecture(
    name="FakeVLForConditionalGeneration",
    model_type="fake_vl",
    model_class=ARCHITECTURES["Qwen3VLForConditionalGeneration"].model_class,
    processor="Qwen3VLProcessor",
    decoder="qwen3",
    tower="qwen3",
    video="qwen3",
    deepstack=True,
    hub_nested=True,
)


@pytest.fixture
def fake_row(monkeypatch: pytest.MonkeyPatch) -> Architecture:
    monkeypatch.setitem(architectures.ARCHITECTURES, FAKE.name, FAKE)
    return FAKE


def relabelled(source: Path, out: Path, row: Architecture) -> Path:
    """A copy of the checkpoint in `source` whose config.json names `row`'s architecture."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=[row.name], model_type=row.model_type)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_new_row_is_served_by_the_registry_and_the_config_reader(
    fake_row: Architecture, qwen3_vl_tiny: Path, tmp_path: Path
):
    from iris_serve.scheduler.models.config import VLModelConfig, architecture_of
    from iris_serve.scheduler.models.qwen3_vl import Qwen3VLForCausalLM
    from iris_serve.scheduler.models.registry import load_config, load_model, model_class

    fake_dir = relabelled(qwen3_vl_tiny, tmp_path / "fake", fake_row)
    assert model_class(fake_row.name) is Qwen3VLForCausalLM
    config = load_config(fake_dir)
    assert config == replace(load_config(qwen3_vl_tiny), architecture=fake_row.name)
    raw = json.loads((fake_dir / "config.json").read_text())
    del raw["architectures"]  # named by model_type alone
    assert architecture_of(raw) == fake_row.name
    assert VLModelConfig.from_dict(raw).architecture == fake_row.name

    model = load_model(fake_dir, torch.float32, "cpu")
    reference = load_model(qwen3_vl_tiny, torch.float32, "cpu")
    assert type(model) is Qwen3VLForCausalLM
    for (name, ours), (_, theirs) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_a_new_row_gets_its_video_rules(
    fake_row: Architecture,
    monkeypatch: pytest.MonkeyPatch,
    qwen3_vl_tiny: Path,
    qwen2_5_vl_tiny: Path,
    tmp_path: Path,
):
    from iris_serve.tokenizer_worker.video.rules import VideoProcessorSettings

    fake_dir = relabelled(qwen3_vl_tiny, tmp_path / "fake", fake_row)
    settings = VideoProcessorSettings.from_checkpoint(fake_dir)
    assert settings == VideoProcessorSettings.from_checkpoint(qwen3_vl_tiny)
    assert settings is not None and not settings.one_block
    # the same files under a row with Qwen2.5-VL's rules follow those
    qwen2_5 = replace(
        FAKE, name="Fake2VLForConditionalGeneration", model_type="fake2_vl", video="qwen2.5"
    )
    monkeypatch.setitem(architectures.ARCHITECTURES, qwen2_5.name, qwen2_5)
    other = relabelled(qwen2_5_vl_tiny, tmp_path / "fake2", qwen2_5)
    settings = VideoProcessorSettings.from_checkpoint(other)
    assert settings == VideoProcessorSettings.from_checkpoint(qwen2_5_vl_tiny)
    assert settings is not None and settings.one_block


def test_an_architecture_without_a_row_is_refused(tmp_path: Path, qwen3_vl_tiny: Path):
    from iris_serve.scheduler.models.registry import load_config
    from iris_serve.tokenizer_worker.video.rules import VideoProcessorSettings

    fake_dir = relabelled(qwen3_vl_tiny, tmp_path / "fake", FAKE)  # FAKE not registered
    with pytest.raises(ValueError, match="unsupported architecture 'FakeVL"):
        load_config(fake_dir)
    assert VideoProcessorSettings.from_checkpoint(fake_dir) is None
