# budgetq image: the producer (`produce`), the RQ workers (`rq worker -w worker.Worker -c worker.settings`),
# the SGLang simulator (`sglang-sim`) and rq-dashboard, all from one small image. See docker-compose.yml.
#
#   docker build -t budgetq:latest .
#
# What this image never contains: secrets (they come from the environment at run time; .dockerignore keeps
# .env and everything else that is not source out of the build context), model weights, tokenizers or
# datasets (mounted at run time), and nothing is downloaded from a model hub: HF_HUB_OFFLINE is set.
# Needs BuildKit (the default builder since Docker Engine 23) or podman/buildah for the `RUN --mount` below;
# `make compose-smoke` builds it with podman 4.3 (docs/deployment.md).
FROM python:3.11-slim

# The versions the compose file's rq-dashboard flags were checked against. rq-dashboard 0.9.0 imports `six`
# without declaring it, so `six` is installed beside it.
ARG RQ_DASHBOARD_VERSION=0.9.0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HOME=/tmp/huggingface

# Extra pip options for the install below, e.g. an offline build from a wheelhouse: with podman,
# `podman build -v "$PWD/wheels:/wheels:ro" --build-arg PIP_INSTALL_OPTS="--no-index --find-links /wheels" .`
# (bench/compose_smoke.py does that). Not a place for credentials: build arguments stay in the image history.
ARG PIP_INSTALL_OPTS=""

# The project is installed from a read-only bind mount of the build context, copied first because pip builds
# in the tree (build/, *.egg-info). The copy is removed in the same step, so no layer keeps the source tree.
# Not a read-write mount: BuildKit throws its writes away, but podman/buildah write them into the context.
RUN --mount=type=bind,target=/src \
    cp -r /src /tmp/budgetq-src \
 && pip install ${PIP_INSTALL_OPTS} /tmp/budgetq-src "rq-dashboard==${RQ_DASHBOARD_VERSION}" six \
 && rm -rf /tmp/budgetq-src \
 && groupadd --system --gid 10001 budgetq \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/budgetq \
        --shell /usr/sbin/nologin budgetq

# Numeric, so orchestrators that check runAsNonRoot can see it is not root.
USER 10001:10001
WORKDIR /home/budgetq

# 9181: rq-dashboard; 30000: sglang-sim. Workers and the producer listen on nothing.
EXPOSE 9181 30000

# The default process is a worker; docker-compose.yml sets the command of every service explicitly.
CMD ["rq", "worker", "-w", "worker.Worker", "-c", "worker.settings"]
