#!/usr/bin/env bash
# The one-shot GPU check of benchmarks/gpu_check.py on a lent machine that has JAX (with CUDA),
# flax, optax, yaml, safetensors and orbax but no Prefect, no Ray and no internet.
#
# What such a machine lacks of training/'s imports is pydantic (training/config.py) and a typing-extensions
# as new as it needs (the image's may be older). They travel
# as wheels: once, on a machine that reaches PyPI, in the repository root,
#     echo /.whl/ >> .git/info/exclude
#     bash benchmarks/gpu_check.sh --fetch-wheels        # pydantic and its needs, CPython 3.12
# then on the GPU machine, with .whl carried along:
#     bash benchmarks/gpu_check.sh --presets small_gpu   # ~4 minutes on one H200 (2026-12-04)
#     bash benchmarks/gpu_check.sh                       # both configs: more than one 10-minute call
#     bash benchmarks/gpu_check.sh --fast ...            # without XLA's determinism flag: cuDNN's
#                                                        # flash attention, hashes not compared
# and here, without a GPU, the same code on tiny models (what tests/test_gpu_check.py runs):
#     bash benchmarks/gpu_check.sh --device cpu
# Extra arguments go to gpu_check.py (--steps N, --presets small_gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 tensorboardX==2.6.5)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    exit 0
fi

if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
    [[ -d .whl ]] || { echo "pydantic is missing and no .whl/ was carried: see the top of $0" >&2; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kiln-site .whl/*.whl
    export PYTHONPATH=/tmp/kiln-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fast=0; args=()
for arg in "$@"; do [[ $arg == --fast ]] && fast=1 || args+=("$arg"); done
if [[ " $* " == *" --device cpu "* ]]; then
    export JAX_PLATFORMS=cpu
elif [[ $fast == 1 ]]; then
    echo "--fast: no determinism flag (XLA_FLAGS=${XLA_FLAGS:-})"
else
    # bitwise-reproducible GPU runs, as training/launch.py sets them for a training step. XLA aborts
    # on a flag it does not know, so each is tried in a throwaway process first (newest name last).
    for flag in --xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true ""; do
        [[ -z "$flag" ]] && { echo "warning: this XLA knows neither determinism flag; runs may differ" >&2; break; }
        if XLA_FLAGS="$flag ${XLA_FLAGS:-}" "$PYTHON" -c "import jax; jax.devices()" >/dev/null 2>&1; then
            export XLA_FLAGS="$flag ${XLA_FLAGS:-}"; echo "XLA_FLAGS=$XLA_FLAGS"; break
        fi
    done
fi
exec "$PYTHON" benchmarks/gpu_check.py ${args[@]+"${args[@]}"}
