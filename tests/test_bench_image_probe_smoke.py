"""The image-count probe runs (`--quick`): it starts its `iris serve`s side by side and
writes its table and plot."""

from __future__ import annotations

from tests.bench_smoke import check_provenance, markdown_tables, run_bench

TIMEOUT_SECONDS = 240  # ~30 s each on 2 idle cores (start-up of two servers dominates)


def test_image_probe_quick(tmp_path):
    cache_dir = tmp_path / "cache"
    run_bench("bench.image_probe", "--quick", "--out", str(tmp_path), cache_dir=cache_dir,
              timeout=TIMEOUT_SECONDS)  # fmt: skip
    text = (tmp_path / "image_probe_tiny_quick.md").read_text()
    check_provenance(text)
    (summary_header, summary), (header, rows) = markdown_tables(text)
    assert summary_header[:3] == ["resolution", "variant", "images (ok)"]
    variants = ("chunk-aware", "whole request", "text only, same tokens")
    assert [(r[0], r[1], r[2]) for r in summary] == [("224x224", v, "1-4") for v in variants]
    assert header == [
        "resolution", "variant", "images", "prompt tok", "status", "TTFT s", "ViT calls",
        "peak RSS +MiB", "arena read MiB", "peak private +MiB", "device peak +MiB", "load avg",
    ]  # fmt: skip
    got = [(r[0], r[1], r[2], r[4]) for r in rows]
    assert got == [("224x224", v, str(n), "ok") for v in variants for n in (1, 2, 4)]
    by_variant = {v: [r for r in rows if r[1] == v] for v in variants}
    for row in by_variant["chunk-aware"] + by_variant["whole request"]:
        assert int(row[3]) > 64 * int(row[2])  # 64 tokens per 224x224 image, plus text
        assert float(row[5]) > 0 and int(row[6]) >= 1
        assert float(row[8]) > 0  # the scheduler read the pixels from the arena
        assert row[10] == "–"  # no device memory on a CPU
    for image_row, text_row in zip(by_variant[variants[0]], by_variant[variants[2]], strict=True):
        assert text_row[3] == image_row[3] and text_row[6] == "0"  # same length, no ViT
    assert (tmp_path / "image_probe_tiny_quick.png").stat().st_size > 0


def test_image_probe_video_quick(tmp_path):
    """`--media video`: one video of 4, 8, 16 frames per request, the frames sampled."""
    cache_dir = tmp_path / "cache"
    run_bench("bench.image_probe", "--media", "video", "--quick", "--out", str(tmp_path),
              cache_dir=cache_dir, timeout=TIMEOUT_SECONDS)  # fmt: skip
    text = (tmp_path / "image_probe_video_tiny_quick.md").read_text()
    check_provenance(text)
    (summary_header, summary), (header, rows) = markdown_tables(text)
    assert summary_header[:3] == ["resolution", "variant", "frames (ok)"]
    assert "MiB per added frame" in summary_header
    variants = ("chunk-aware", "whole request", "text only, same tokens")
    assert [(r[0], r[1], r[2]) for r in summary] == [("160x96", v, "4-16") for v in variants]
    assert header[2] == "frames"
    got = [(r[0], r[1], r[2], r[4]) for r in rows]
    assert got == [("160x96", v, str(n), "ok") for v in variants for n in (4, 8, 16)]
    by_variant = {v: [r for r in rows if r[1] == v] for v in variants}
    for row in by_variant["chunk-aware"] + by_variant["whole request"]:
        # 160x96 frames are resized to 168x84: 18 tokens per 2-frame patch, plus text
        assert int(row[3]) > 9 * int(row[2])
        assert float(row[5]) > 0 and int(row[6]) >= 1
        assert float(row[8]) > 0  # the scheduler read the patches from the arena
    for video_row, text_row in zip(by_variant[variants[0]], by_variant[variants[2]], strict=True):
        assert text_row[3] == video_row[3] and text_row[6] == "0"  # same length, no ViT
    assert (tmp_path / "image_probe_video_tiny_quick.png").stat().st_size > 0
