# diloco-async image: the synchronizer, a learner (or a torchrun learner group) and the Prefect
# flows, all from one image. CPU torch by default; a CUDA build with
#   docker build --build-arg TORCH_INDEX=https://pypi.org/simple -t diloco-async:0.1.0-cuda .
# (PyPI's Linux torch wheels bundle CUDA; the host needs the NVIDIA container toolkit).
#   docker build -t diloco-async:0.1.0 .
#   docker run --rm diloco-async:0.1.0 diloco-async --version
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_OFFLINE=1 PREFECT_HOME=/app/.local/prefect

WORKDIR /app
# torch first, from the chosen index, so the pinned requirements do not pull another build
COPY requirements.txt constraints.txt ./
RUN pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "torch==2.13.0" \
 && pip install -r requirements.txt -c constraints.txt

COPY pyproject.toml README.md prefect.yaml ./
COPY diloco_async ./diloco_async
COPY storage ./storage
COPY flows ./flows
COPY configs ./configs
RUN pip install --no-deps . && diloco-async --version

# a process started by hand: python -m diloco_async.server ... / python -m diloco_async.learner ...
# (see README "Running across machines by hand"); a Prefect worker runs the flows' entrypoints.
CMD ["diloco-async", "--help"]
