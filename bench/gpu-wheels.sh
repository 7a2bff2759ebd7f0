#!/usr/bin/env bash
# The wheels bench/gpu_fsdp.py needs beyond what the GPU machine has (FACTS: Python 3.12, torch, transformers,
# tokenizers, safetensors, pyarrow, numpy, huggingface_hub, ...; no pydantic, no boto3, no Ray): pydantic and
# what it needs, at requirements.lock's versions. The trainer imports boto3 only for S3 uploads and Ray only
# under Ray Train, so the benchmark (local disk, one process) needs neither. typing_extensions comes along
# although torch brings one: pydantic_core needs a newer one than older torch images carry.
#
#   bench/gpu-wheels.sh DIR     downloads the wheels into DIR and prints the command to run on the GPU
#                               machine (from the repository root, with DIR sent along)
#
# PYTHON_VERSION (default 3.12, the GPU machine's) picks the interpreter the wheels are for; the tests use
# their own. pip is the one of $PYTHON (default python3).
set -euo pipefail

dir=${1:?usage: bench/gpu-wheels.sh DIR}
python_version=${PYTHON_VERSION:-3.12}
python=${PYTHON:-python3}
lock="$(cd "$(dirname "$0")/.." && pwd)/requirements.lock"
packages=(pydantic pydantic_core annotated-types typing-inspection typing_extensions)

pins=()
for package in "${packages[@]}"; do
  pin=$(grep -i -E "^${package}==" "$lock") || { echo "no pin for ${package} in ${lock}" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp --platform manylinux_2_17_x86_64 --dest "$dir" "${pins[@]}" >&2
echo "python3 -m pip install --quiet --no-deps --no-index --target $dir/site $dir/*.whl && PYTHONPATH=$dir/site\${PYTHONPATH:+:\$PYTHONPATH} python3 bench/gpu_fsdp.py"
