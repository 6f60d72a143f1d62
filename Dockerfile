# diloco-async image (CPU): the synchronizer, a learner (or a torchrun learner group) and the
# Prefect flows, all from one image. The CUDA variant is Dockerfile.cuda (same steps, CUDA torch).
#   docker build -t diloco-async:0.1.0 .
#   docker run --rm diloco-async:0.1.0 diloco-async validate default
# Built here? No: the machines this project is tested on have no container daemon;
# tests/unit/test_container.py checks what can be checked without one (docs/deployments.md "Container images").
#
# Base pinned to the Python of the tested environment (3.11.7). For a reproducible registry
# build pin its digest too: FROM python:3.11.7-slim-bookworm@sha256:<digest>
# (`docker buildx imagetools inspect python:3.11.7-slim-bookworm` prints it).
FROM python:3.11.7-slim-bookworm

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_OFFLINE=1 PREFECT_HOME=/app/.local/prefect HOME=/home/diloco \
    DILOCO_CHECKOUT=/app

# an unprivileged user with a numeric id (Kubernetes runAsNonRoot can check it)
RUN groupadd --gid 10001 diloco && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/diloco diloco

WORKDIR /app
# torch first, from the chosen index, so the pinned requirements do not pull another build; then
# exactly the repository's pins (constraints.txt is the full freeze of the tested environment)
COPY requirements.txt constraints.txt ./
RUN pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple -c constraints.txt "torch==2.13.0" \
 && pip install -r requirements.txt -c constraints.txt

COPY pyproject.toml README.md prefect.yaml ./
COPY diloco_async ./diloco_async
COPY configs ./configs
COPY scripts/check_pins.py ./scripts/check_pins.py
# the package with its recipes (configs/ is the package diloco_recipes), then the checks: every
# installed distribution is one of the pins, the console script runs and finds the recipes
RUN pip install --no-deps . \
 && python scripts/check_pins.py constraints.txt && pip check \
 && diloco-async --version && diloco-async recipes \
 && mkdir -p /app/.local /app/data && chown -R 10001:10001 /app

USER 10001:10001
# No ENTRYPOINT: a Prefect Kubernetes or ECS worker replaces the command with its own
# (`prefect flow-run execute`), and a process started by hand names its own:
#   python -m diloco_async.server ... / python -m diloco_async.learner ... (docs/deployments.md "Running across machines by hand")
CMD ["diloco-async", "--help"]
