# Iris on a GPU node:
#   docker build -t iris .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       iris Qwen/Qwen2.5-VL-3B-Instruct --served-model-name qwen2.5-vl
#
# The base image brings a CUDA build of PyTorch; `pip install .` keeps it because Iris
# asks only for torch>=2.4. Override BASE_IMAGE to pin another CUDA/PyTorch pair.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/root/.cache/huggingface

WORKDIR /opt/iris
COPY pyproject.toml README.md ./
COPY server ./server
COPY tokenizer_worker ./tokenizer_worker
COPY scheduler ./scheduler
COPY ipc ./ipc
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && pip install . \
    && python -c "import torch; assert torch.version.cuda, 'pip replaced the CUDA torch'"

EXPOSE 8000
# Shared-memory arenas live in /dev/shm: each tokenizer worker (2 by default) takes
# --mm-processor-cache-gb (1 GiB by default), so run with --shm-size=4g or more (or
# --ipc=host). With Docker's default 64 MiB, `iris serve` refuses to start and says so.
ENTRYPOINT ["iris", "serve", "--host", "0.0.0.0", "--port", "8000"]
