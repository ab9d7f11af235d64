#!/usr/bin/env bash
# The package as the team's GPU machines run it, checked on this CPU: their image's torch 2.11.0 / Triton 3.6.0
# (below pyproject's floor), the checkout on PYTHONPATH without installing it (as the team's GPU kit puts it there).
# A fault found here costs minutes; found on the card it costs the GPU session (docs/versions.md).
#
#   bash scripts/gpu_image_check.sh [VENV]     # VENV: kept between runs (default /tmp/tokcomp-gpu-image)
#
# Runs: the traced graphs of the launched kernels (tests/tensors/trace_launched_steps.py), the kit's compiled-speed
# dry run where the kit sits beside the checkout (../shared/gpu), and the test files of the GPU paths (about
# 25 minutes on 2 cores). Exit status: the tests'.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${1:-/tmp/tokcomp-gpu-image}
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
# NumPy < 2.4: Triton 3.6's CPU interpreter (the kernel tests) fails under 2.4
"$venv/bin/pip" install -q "torch==2.11.0" "triton==3.6.0" "torchvision==0.26.0" "timm==1.0.31" "numpy<2.4" \
    safetensors huggingface-hub peft scipy matplotlib hypothesis pytest pytest-xdist
export PYTHONPATH=$root
py=$venv/bin/python
$py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
$py tests/tensors/trace_launched_steps.py > /dev/null  # set -e: a failure stops here
echo "launched kernels traced"
if [[ -d ../shared/gpu ]]; then
    bash ../shared/gpu/prepare.sh > /dev/null
    for section in "deitb 4" "attn 4" "eva 4" "prof 4"; do
        # shellcheck disable=SC2086
        DRY=1 OUT=$(mktemp -d) $py .gpu/compiled.py $section > /dev/null 2>&1 \
            && echo "kit dry run '$section': ran" || { echo "kit dry run '$section': FAILED"; exit 1; }
    done
fi
$py -m pytest -p no:cacheprovider -n 2 -q \
    tests/tensors/test_fused_kernels.py tests/tensors/test_fused_counts.py tests/tensors/test_kernel_compilation.py \
    tests/tensors/test_operator_shapes.py tests/tensors/test_graphs.py tests/tensors/test_attention.py \
    tests/models/test_compile.py \
    tests/models/test_compiled_whole.py tests/models/test_compiling.py tests/models/test_rope_tables.py \
    tests/models/test_families.py tests/models/test_patch.py tests/models/test_dense.py tests/models/test_naflex.py \
    tests/models/test_host_syncs.py tests/commands/test_selfcheck.py tests/commands/test_speed.py \
    tests/commands/test_bench.py tests/commands/test_tune.py tests/commands/test_tune_budget.py \
    tests/commands/test_tune_choice.py tests/commands/test_tune_search.py tests/kit/test_kit.py
