# GPU image: rope's test suite and benchmarks on your card (README, "Docker").
#   docker build -t rope .
#   docker run --rm --gpus all rope                                        # the GPU test suite
#   docker run --rm --gpus all rope python -m pytest --benchmark-only      # the benchmarks
#   docker run --rm --gpus all -v "$PWD/bench-out:/rope/bench-out" rope \
#       python -m pytest --benchmark-only --benchmark-json=bench-out/results.json
# Needs the NVIDIA Container Toolkit on the host and a driver for CUDA 13 (R580 or newer), the
# CUDA version of PyPI's torch 2.11 wheels.
FROM python:3.11-slim-bookworm

# Triton compiles a small C launcher when it first runs a kernel: it needs a C compiler and
# Python's headers (those ship with this image). Debian's security updates replace exact versions,
# so the packages are pinned by the release of the base image rather than by version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /rope

# The tested GPU pair (the oldest supported), in its own layer: editing the code does not
# reinstall it. The commands are the README's install commands.
RUN python -m pip install "torch==2.11.0" "triton==3.6.0"
COPY . .
RUN python -m pip install -e ".[test,bench]"

# One worker per core: the GPU suite is bound by Triton compiles, not by the GPU. The suite hands the
# tests to the workers itself, longest first (tests/scheduling.py), so the minute-long properties do not
# queue up behind each other.
CMD ["python", "-m", "pytest", "-q", "-n", "auto"]
