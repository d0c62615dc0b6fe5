# mesh-runtime image for KServe ModelMesh Serving (see deploy/servingruntime.yaml).
#
#   docker build -t mesh-runtime:0.1.0 .
#   docker build -t mesh-runtime:0.1.0-slim --build-arg EXTRAS= .      # python models only
#   docker build --build-arg EXTRAS=sklearn,xgboost,lightgbm,onnx .      # no torch (much smaller)
#
# Built from this repository alone: the build context is the repo (.dockerignore
# trims it) and the only downloads are PyPI packages. The image listens on 8085
# (RUNTIME_PORT) without EXPOSEing it: ModelMesh Serving forbids declaring 8085
# and the other ports model-mesh reserves (8080, 8089, 8090, 11881-11899).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv holding the runtime and the chosen framework extras
FROM ${PYTHON_IMAGE} AS build

# Optional extras of setup.cfg to install (comma-separated; empty for none). `all`
# installs every framework the format table knows; an extra pip does not know is
# only a warning.
ARG EXTRAS=all

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/mesh-runtime

COPY . /src
RUN /opt/mesh-runtime/bin/pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}"

# ---- runtime image
FROM ${PYTHON_IMAGE}

# uid 1000, primary group 0: the folders below are group-writable so the image
# also runs under an arbitrary uid in group 0 (OpenShift's restricted SCC).
# RUNTIME_DIR itself is not created here: the runtime makes it at start (mode
# 0700, owned by whoever runs it) and removes it at stop, inside a home folder
# the user owns.
# tini as PID 1: it reaps any process re-parented to it (say, a worker whose
# fork server died), which the front, as PID 1, would leave as a zombie. Not
# pinned: Debian replaces point versions with security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --uid 1000 --gid 0 --home-dir /home/mesh --create-home \
        --shell /usr/sbin/nologin mesh \
    && mkdir -p /models \
    && chown 1000:0 /home/mesh /models \
    && chmod 0775 /home/mesh /models

COPY --from=build /opt/mesh-runtime /opt/mesh-runtime

ENV PATH=/opt/mesh-runtime/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/mesh \
    RUNTIME_DIR=/home/mesh/run \
    ROOT_MODEL_DIR=/models

USER 1000:0
WORKDIR /home/mesh

# `python -m runtime` rather than the mesh-runtime script: multiprocessing
# re-imports a script-style main module in every new worker, a `-m` one not.
ENTRYPOINT ["tini", "--", "python", "-m", "runtime"]
