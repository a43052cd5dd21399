#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine needs beyond its image, into .whl/ (git-ignored; carried with the
# checkout by the device `run` tool's `carry: [".whl"]`, 64 MiB at most).
#
# The image has torch 2.11 + CUDA 13, triton 3.6, transformers 5.17, accelerate, peft, safetensors (and what they
# depend on: numpy, huggingface-hub, jinja2, pyyaml, packaging, ...), no diffusers and no network. What is carried:
#   * the pins the generated files derive from: transformers==5.14.1, diffusers==0.40.0, and tokenizers==0.22.2
#     (transformers 5.14.1 checks tokenizers <= 0.23.0 at import; the image's may be newer);
#   * what the runtime and the CUDA tests import beyond the image: libcst (patchgen.model, via the tiny configs),
#     typer (+ click, shellingham, rich, markdown-it-py, mdurl, pygments, pydantic, pydantic-core, annotated-types,
#     typing-inspection, annotated-doc), ftfy + wcwidth (diffusers' Wan prompt cleaning), Pillow (the Wan
#     condition model and the rewards), importlib_metadata + zipp (diffusers), pytest + pluggy + iniconfig;
# versions as in the dev venv (`make venv`). Platform wheels for CPython 3.12 manylinux x86_64.
#
# The wheels are downloaded into a stage inside $DEST, checked (one per pin, each a readable zip) and then replace the
# wheels of $DEST, pinned by hash in $DEST/requirements.txt (bench/gpu_check/pin_wheels.py); stale wheels of an
# earlier pin list are removed, a failed download or check leaves $DEST as it was.
#
# On the GPU machine (see docs/performance.md, "GPU check"), only the pinned bytes are installed:
#   python3 -m pip install -q --require-hashes --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
#     --upgrade --target /tmp/site -r .whl/requirements.txt \
#     && export PYTHONPATH=/tmp/site:$PWD && python3 -m bench.gpu_check --out $OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl}
PY=${PY:-python3}
mkdir -p "$DEST"
STAGE=$(mktemp -d "$DEST/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT

PURE=(
  transformers==5.14.1 diffusers==0.40.0
  typer==0.29.2 click==8.5.1 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7
  ftfy==6.3.1 wcwidth==0.9.4 importlib_metadata==9.1.0 zipp==4.1.2
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
)
PLATFORM=(tokenizers==0.22.2 libcst==1.9.0 pydantic-core==2.50.5 pillow==13.0.0)

download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "$@" -d "$STAGE"
}
download "${PURE[@]}"
download --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${PLATFORM[@]}"

total=$(du -cb "$STAGE"/*.whl | tail -1 | cut -f1)
if [ "$total" -gt $((56 * 1024 * 1024)) ]; then
  echo "error: over 56 MiB: no room left under the 64 MiB carry for the checkout itself; $DEST left as it was" >&2
  exit 1
fi
"$PY" -m bench.gpu_check.pin_wheels "$STAGE" "$DEST" $(( ${#PURE[@]} + ${#PLATFORM[@]} ))
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST, pinned by hash in $DEST/requirements.txt:" \
  "$((total / 1024 / 1024)) MiB (the carry limit is 64 MiB)"
