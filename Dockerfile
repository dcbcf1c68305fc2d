# Iris on a GPU node:
#   docker build -t iris .
#   docker run --gpus all --shm-size 3g -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       iris Qwen/Qwen2.5-VL-3B-Instruct --served-model-name qwen2.5-vl
#
# The base image brings a CUDA build of PyTorch (and the Triton that the `triton`
# attention backend compiles with); `pip install .` keeps it because Iris asks only for
# torch>=2.4 and none of its dependencies asks for torch (tests/test_wheel.py).
# Override BASE_IMAGE to pin another CUDA/PyTorch pair.
#
# A node of a Dynamo fleet (`iris serve MODEL --dynamo`, docs/scale-out.md) needs Dynamo's
# runtime and frontend packages: `docker build --build-arg WITH_DYNAMO=1 -t iris .`
# installs them (the `[dynamo]` extra, then `ai-dynamo` without its requirements, as the
# README's recipe does).
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG WITH_DYNAMO=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/root/.cache/huggingface

WORKDIR /opt/iris
COPY pyproject.toml README.md ./
COPY common ./common
COPY ipc ./ipc
COPY launch ./launch
COPY server ./server
COPY tokenizer_worker ./tokenizer_worker
COPY scheduler ./scheduler
COPY tiny_checkpoint ./tiny_checkpoint
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && pip install . \
    && if [ "$WITH_DYNAMO" = 1 ]; then \
        pip install '.[dynamo]' && pip install --no-deps ai-dynamo==1.6.1 \
        && python -c "import dynamo.llm"; \
    fi \
    && python -c "import torch; assert torch.version.cuda, 'pip replaced the CUDA torch'" \
    && iris serve --help > /dev/null

EXPOSE 8000
# Shared memory: each tokenizer worker (2 by default) reserves an arena of
# --mm-processor-cache-gb (1 GiB by default) in /dev/shm at start-up, so at the defaults
# run with --shm-size 3g (the arenas plus 1 GiB for the rest) or --ipc=host. With
# Docker's default of 64 MiB, `iris serve` refuses to start and names the size it needs.
#
# Loading a real checkpoint takes minutes; /health answers 200 once every process is up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT ["iris", "serve", "--host", "0.0.0.0", "--port", "8000"]
