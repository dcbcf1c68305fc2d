#!/usr/bin/env bash
# The GPU campaign, on the device tool's GPU machine: one call per stage or two.
#
#   here:   python -m bench.gpu.prepare                  # wheels the device lacks -> .whl/
#   there:  bash bench/gpu/campaign.sh STAGE...          # a `run` with carry [".whl"]
#
# Stages, each meant to fit the device's 10-minute command limit (times measured on an
# H100 on 2026-11-26 where given, else estimated; a session has 15 device minutes in
# all, and a machine's start took ~40 s):
#   env        nvidia-smi, driver and package versions                    11 s
#   tests      pytest -m gpu: greedy tokens against transformers on the
#              GPU in fp32 and bf16 per attention backend, every backend
#              against sdpa                                            50-65 s
#   roofline   bench.roofline on the real-size checkpoint             ~3 min
#   serve      bench.serve_load: Iris (the encoder inside the steps, the CUDA
#              default) and the variant `thread` (--mm-encoder-placement thread), random-mm
#              and text (SERVE_ARGS: more bench.serve_load flags)     ~4 min
#   scenarios  bench.serve_load's agent workloads (append, window), the same
#              two servers                                                ~6 min
#   images     bench.image_probe: 1..64 1280x720 images in one request    ~5 min
#   peers      bench.peers: Iris vs transformers serve on the cold, append and
#              window workloads                                           ~8 min
#   (the first stage that needs the checkpoint generates it: 28 s more)
#
# The first call on a machine installs the wheels into its Python (the machine is bare
# each lease) and generates the checkpoint (MODEL_LIKE, default Qwen2.5-VL-7B-Instruct:
# its published config, random bf16 weights) on its disk; later calls on the same warm
# machine reuse both. Results land in $OUT (at most 8 files come back per call), named
# as under bench/results/, which is where they are committed, device named in each.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/iris-campaign}
LIKE=${MODEL_LIKE:-Qwen2.5-VL-7B-Instruct}
MODEL=/tmp/iris-models/${LIKE}-random-bf16
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -gt 0 ] || usage

install() {
    [ -f .whl/SOURCES ] || { echo "no .whl/: run python -m bench.gpu.prepare here first, carry .whl"; exit 2; }
    local digest
    digest=$("$PY" -m bench.gpu.prepare --digest)
    if [ "$digest" != "$(cat .whl/SOURCES)" ]; then
        echo "the wheels were built from other sources than this tree's: run python -m bench.gpu.prepare again"
        exit 2
    fi
    if [ "$(cat /tmp/iris-installed 2>/dev/null)" != "$digest" ]; then
        "$PY" -m pip install -q --no-index --find-links .whl --no-compile \
            --disable-pip-version-check --root-user-action=ignore .whl/*.whl
        echo "$digest" > /tmp/iris-installed
    fi
    IRIS_COMMIT=$(cat .whl/COMMIT)
    export IRIS_COMMIT
}

checkpoint() {
    if [ ! -f "$MODEL/.complete" ]; then
        rm -rf "$MODEL"
        iris tiny-model --like "$LIKE" --out "$MODEL" --device cuda
        touch "$MODEL/.complete"
    fi
}

stage() {
    local started=$SECONDS
    echo "== $1 ($(date -u +%H:%M:%S))"
    case "$1" in
        env)
            { nvidia-smi; "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| triton', triton.__version__)"; "$PY" -m pip list 2>/dev/null | grep -iE '^(iris-serve|fastapi|uvicorn|pyzmq|msgspec|llguidance) ' || true; } | tee "$OUT/env.txt" ;;
        tests)
            "$PY" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" ;;
        roofline)
            checkpoint
            "$PY" -m bench.roofline --model "$MODEL" --device cuda --dtype bfloat16 --out "$OUT" ;;
        serve)
            checkpoint
            "$PY" -m bench.serve_load --model "$MODEL" --device cuda --num-prompts 32 \
                --concurrency 8 --variant "thread=--mm-encoder-placement thread" --out "$OUT" ${SERVE_ARGS:-} ;;
        scenarios)
            checkpoint
            "$PY" -m bench.serve_load --model "$MODEL" --device cuda --workloads append,window \
                --variant "thread=--mm-encoder-placement thread" --name "serve_load_${LIKE}_agent" --out "$OUT" ;;
        images)
            checkpoint
            "$PY" -m bench.image_probe --model "$MODEL" --out "$OUT" ;;
        peers)
            checkpoint
            "$PY" -m bench.peers --model "$MODEL" --peers iris,transformers \
                --workloads image,append,window --device cuda --out "$OUT" ;;
        *)
            echo "unknown stage: $1"; usage ;;
    esac
    echo "== $1 took $((SECONDS - started)) s"
}

for name in "$@"; do
    case "$name" in env|tests|roofline|serve|scenarios|images|peers) ;; *) echo "unknown stage: $name"; usage ;; esac
done
install
for name in "$@"; do
    stage "$name"
done
