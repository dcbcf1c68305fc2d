"""`bench.server_process.parse_metrics` on a data-parallel server's /metrics: the
benchmarks read unlabelled engine counters, so samples seen only per replica also get
their sum over replicas under the unlabelled name."""

from __future__ import annotations

from bench.server_process import parse_metrics

DATA_PARALLEL = """\
# HELP iris_mm_images_encoded_total Images through the vision encoder.
# TYPE iris_mm_images_encoded_total counter
iris_mm_images_encoded_total{replica="0"} 3.0
iris_mm_images_encoded_total{replica="1"} 5.0
# TYPE iris_num_requests_running gauge
iris_num_requests_running{replica="0"} 1.0
iris_num_requests_running{replica="1"} 0.0
# TYPE iris_tokenizer_requests_total counter
iris_tokenizer_requests_total 12.0
# TYPE iris_mm_encoder_seconds histogram
iris_mm_encoder_seconds_bucket{le="0.1"} 2.0
iris_mm_encoder_seconds_bucket{le="+Inf"} 8.0
iris_mm_encoder_seconds_sum 1.5
iris_mm_encoder_seconds_count 8.0
iris_step_seconds_bucket{le="0.5",replica="0"} 4.0
iris_step_seconds_bucket{replica="1",le="0.5"} 6.0
"""


def test_replica_samples_are_kept_and_summed_under_the_unlabelled_name():
    values = parse_metrics(DATA_PARALLEL)
    assert values['iris_mm_images_encoded_total{replica="0"}'] == 3.0
    assert values['iris_mm_images_encoded_total{replica="1"}'] == 5.0
    assert values["iris_mm_images_encoded_total"] == 8.0
    assert values["iris_num_requests_running"] == 1.0


def test_other_labels_stay_as_they_are():
    values = parse_metrics(DATA_PARALLEL)
    assert values['iris_mm_encoder_seconds_bucket{le="0.1"}'] == 2.0
    assert values['iris_mm_encoder_seconds_bucket{le="+Inf"}'] == 8.0
    assert values["iris_mm_encoder_seconds_sum"] == 1.5
    assert values["iris_tokenizer_requests_total"] == 12.0
    # a per-replica histogram: summed per bucket, its `le` kept
    assert values['iris_step_seconds_bucket{le="0.5"}'] == 10.0
    assert "iris_mm_encoder_seconds_bucket" not in values


def test_a_single_scheduler_reads_as_before():
    text = "iris_mm_images_encoded_total 7.0\niris_generation_tokens_total 64.0\n"
    assert parse_metrics(text) == {
        "iris_mm_images_encoded_total": 7.0,
        "iris_generation_tokens_total": 64.0,
    }


def test_the_model_name_label_is_left_out():
    text = (
        'iris_generation_tokens_total{model_name="m"} 64.0\n'
        'iris_mm_images_encoded_total{model_name="m",replica="0"} 3.0\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 9.0\n'
    )
    assert parse_metrics(text) == {
        "iris_generation_tokens_total": 64.0,
        'iris_mm_images_encoded_total{replica="0"}': 3.0,
        "iris_mm_images_encoded_total": 3.0,
        'vllm:prompt_tokens_total{engine="0"}': 9.0,
    }


def test_an_unlabelled_sample_of_the_same_name_is_not_overwritten():
    text = 'x_total 1.0\nx_total{replica="0"} 2.0\nx_total{replica="1"} 3.0\n'
    assert parse_metrics(text)["x_total"] == 1.0
