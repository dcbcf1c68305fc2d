"""The weights and the KV cache of a CPU rank on huge pages (`scheduler/huge_pages.py`):
values, sharing and identities kept, and the kernel's huge pages where it gives them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from iris_serve.scheduler import huge_pages


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    return 0


class Tower(nn.Module):
    def __init__(self, shared: nn.Linear, table: torch.Tensor) -> None:
        super().__init__()
        self.big = nn.Linear(1024, 2048)  # 8 MiB: collapsed where it lies
        self.small = nn.Linear(64, 32)  # into an arena
        self.shared = shared  # tied: the same module (its parameters) in two places
        self.register_buffer("table", table)  # a buffer two modules hold
        self.register_buffer("strided", torch.randn(8, 8).t(), persistent=False)  # not moved


def test_weights_keep_their_values_sharing_and_objects():
    shared = nn.Linear(16, 16)
    table = torch.arange(300, dtype=torch.bfloat16)
    model = nn.ModuleDict({"a": Tower(shared, table), "b": Tower(shared, table)})
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    parameters = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    moved = huge_pages.collapse_weights(model)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    after = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    assert after == parameters  # a parameter keeps its object; its .data moved
    a, b = model["a"], model["b"]
    assert a.shared.weight is b.shared.weight
    assert a.table is b.table and a.table.data_ptr() == b.table.data_ptr()
    if not huge_pages.enabled():
        assert moved == 0
        return
    # the small tensors side by side in one arena; the big one in place, on huge pages
    small = [a.small.weight, a.small.bias, a.shared.weight, a.table, b.small.weight]
    arenas = {tensor.untyped_storage().data_ptr() for tensor in small}
    assert len(arenas) == 1
    assert a.strided.stride() == (1, 8)
    assert moved > 0
    assert huge_bytes_at(a.big.weight.data_ptr() + (4 << 20)) > 0
    assert huge_bytes_at(a.small.weight.data_ptr()) > 0


def test_the_kv_cache_faults_in_as_huge_pages(monkeypatch):
    """`zeros` gives zeros; where the kernel allows, on huge pages; with
    `IRIS_HUGE_PAGES=0`, neither asked for nor moved."""
    cache = huge_pages.zeros(4, 1 << 20, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.shape == (4, 1 << 20) and not cache.any()
    if huge_pages.enabled():
        assert huge_bytes_at(cache.data_ptr() + (4 << 20)) > 0
    monkeypatch.setenv("IRIS_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    assert huge_pages.collapse_weights(nn.Linear(2048, 2048)) == 0


@pytest.mark.parametrize("setting", ["always [madvise] never", "always madvise [never]"])
def test_the_systems_setting_decides(tmp_path, monkeypatch, setting):
    path = tmp_path / "enabled"
    path.write_text(setting + "\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", str(path))
    monkeypatch.delenv("IRIS_HUGE_PAGES", raising=False)
    assert huge_pages.enabled() == ("[madvise]" in setting)
