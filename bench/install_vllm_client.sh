#!/usr/bin/env bash
# Installs the real `vllm bench serve` load generator as a CPU-only CLIENT, in its own
# venv, without any CUDA package: CPU torch first, then vllm with --no-deps, then only the
# modules its benchmark code imports (found by iterating on ImportError; all pinned, all
# --no-deps so nothing heavy is resolved behind our back). ~1.5 GB, a few minutes.
#
# It also puts the two packages `transformers serve` (the peer in bench.serve_load) needs
# beyond Iris's own venv -- accelerate and psutil, ~0.6 MB, from transformers' [serving]
# extra -- into $VENV/peer-site, a folder that bench.serve_load adds to the peer's
# PYTHONPATH; Iris's venv itself is left untouched.
#
# Usage (idempotent: a venv whose stamp matches these pins is left as it is; otherwise
# pip re-checks every pin and installs only what differs):
#   bash bench/install_vllm_client.sh [VENV]      # default: ${IRIS_CACHE_DIR:-~/.cache/iris}/vllm-client
# The last line printed is the venv's path. bench.serve_load finds it at that default
# place, or pass --vllm VENV/bin/vllm.
set -euo pipefail

VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
VENV=${1:-${VENV:-${IRIS_CACHE_DIR:-$HOME/.cache/iris}/vllm-client}}
PY=${PY:-python3}

# Everything `vllm bench serve` imports besides torch and vllm (the last four -- uvicorn,
# click, watchfiles, orjson -- only for the `vllm` CLI entry point).
CLIENT_DEPS=(
  packaging==26.3 numpy==2.4.6 regex==2026.11.15 pyyaml==6.0.3 tqdm==4.70.1
  aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 idna==3.20 propcache==0.5.4
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
  pybase64==1.5.1 pillow==13.0.0
  transformers==5.20.2 tokenizers==0.23.3 safetensors==0.8.0 huggingface-hub==2.4.0
  httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 truststore==0.10.5
  msgspec==0.22.0 pydantic==2.14.3 pydantic-core==2.50.4 typing-inspection==0.4.5 annotated-types==0.8.0
  cbor2==6.2.1 psutil==7.2.2 pyzmq==27.3.0
  requests==2.34.2 urllib3==2.8.0 certifi==2026.10.18 charset-normalizer==3.5.2
  openai==3.52.0 sniffio==1.3.1 anyio==4.16.0 oss-harmony==0.0.11
  cachetools==8.0.0 cloudpickle==3.1.2 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus-client==0.26.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 partial-json-parser==0.2.1.1.post7 einops==0.8.2
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  uvicorn==0.54.0 click==8.5.1 watchfiles==1.3.0 orjson==3.13.0
)
# transformers[serving] needs these on top of Iris's venv (pure Python + one abi3 wheel).
PEER_DEPS=(accelerate==1.15.0 psutil==7.2.2)

# What a finished install records; a venv that has exactly this is left as it is.
STAMP="$VENV/.iris-vllm-client"
WANT="torch==$TORCH_VERSION vllm==$VLLM_VERSION ${CLIENT_DEPS[*]} peer: ${PEER_DEPS[*]}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && "$VENV/bin/python" -c "import vllm.benchmarks.serve" 2>/dev/null; then
  echo "vllm $VLLM_VERSION client already installed" >&2
  echo "$VENV"
  exit 0
fi

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1) CPU torch before anything else: vllm/__init__ imports torch, and a bare
#    `pip install torch` (or vllm's own requirements) would resolve a CUDA build.
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"

# 2) vllm without its dependency tree (which pulls a CUDA torch, flashinfer, cutlass, ...).
"${PIP[@]}" install -q --no-deps "vllm==$VLLM_VERSION"

# 3) the minimal import set, pinned, without dependencies.
"${PIP[@]}" install -q --no-deps "${CLIENT_DEPS[@]}"

# 4) the client never loads vllm's GPU kernels; dropping them saves ~600 MB.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
find "$site/vllm" -name '*.so' -delete

# 5) the peer's extras, apart from Iris's venv (see the header).
"${PIP[@]}" install -q --no-deps --upgrade --target "$VENV/peer-site" "${PEER_DEPS[@]}"

# Check: the benchmark's modules import and the CLI answers.
"$VENV/bin/python" -c "import vllm.benchmarks.serve, vllm.benchmarks.datasets"
HF_HUB_OFFLINE=1 "$VENV/bin/vllm" bench serve --help >/dev/null
echo "$WANT" >"$STAMP"
echo "vllm $VLLM_VERSION client ready in $(( $(date +%s) - t0 )) s; $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV"
