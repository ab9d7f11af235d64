#!/usr/bin/env bash
# Runs the whole test suite against each (torch, timm) combination, each in its own fresh virtualenv, and
# prints a Markdown table of the results (also written to compat_matrix.md, logs to compat_logs/).
#
# Too slow for CI: every combination installs a CUDA build of torch (several GB, cached by pip after the
# first download) and runs the full suite (about 25 minutes on 2 CPU cores). Run it by hand when the
# dependency range in pyproject.toml changes, and paste the table into docs/versions.md.
#
#   scripts/compat_matrix.sh                       # the combinations below
#   scripts/compat_matrix.sh 2.15.0:1.0.31 ...     # TORCH:TIMM pairs of your own
#
# Machine-wide pip settings can cap torch (a constraints file in pip's config); only the versions named
# here should decide, so pip runs with PIP_CONFIG_FILE=/dev/null (no config files; PIP_* variables stay).
set -uo pipefail
cd "$(dirname "$0")/.."

combos=("$@")
if [[ ${#combos[@]} -eq 0 ]]; then
    # newest torch served and the oldest whose suite passes (2.12: before it, Triton <= 3.6's CPU interpreter cannot
    # run the kernel tests under NumPy 2.4); newest timm and the oldest supported 1.0.x
    # (timm < 1.0.16 has no timm.layers.Attention; before 1.0.21 a ViT cannot be built on the meta device,
    # before 1.0.23 Attention takes no attn_head_dim: 23 tests fail on 1.0.16)
    combos=(2.15.0:1.0.31 2.15.0:1.0.23 2.12.0:1.0.31 2.12.0:1.0.23)
fi
logs=${MATRIX_LOGS:-compat_logs}
table=${MATRIX_OUT:-compat_matrix.md}
mkdir -p "$logs"

rows=()
for combo in "${combos[@]}"; do
    torch_v=${combo%%:*}
    timm_v=${combo##*:}
    log="$logs/torch-${torch_v}_timm-${timm_v}.log"
    venv=$(mktemp -d "${TMPDIR:-/tmp}/tokcomp-matrix.XXXXXX")
    echo "== torch $torch_v, timm $timm_v (venv $venv, log $log)"
    start=$(date +%s)
    result="install failed"
    if python3 -m venv "$venv" >"$log" 2>&1 \
        && PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q -e ".[test]" \
            "torch==$torch_v" "timm==$timm_v" >>"$log" 2>&1; then
        versions=$("$venv/bin/python" -c "import torch, timm, torchvision, peft, huggingface_hub as h; \
print(f'{torch.__version__} | {timm.__version__} | {torchvision.__version__} | {peft.__version__} | {h.__version__}')")
        "$venv/bin/python" -m pytest -q -p no:cacheprovider >>"$log" 2>&1
        result=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$log" | tail -1 | sed -E 's/=+//g; s/ in [0-9.]+s.*//; s/^ +| +$//g')
        [[ -n "$result" ]] || result="no test ran: $(grep -E "Error" "$log" | tail -1 | cut -c1-80)"
    else
        versions="$torch_v | $timm_v | - | - | -"
    fi
    minutes=$(( ($(date +%s) - start + 59) / 60 ))
    rows+=("| $versions | $result | $minutes |")
    echo "   ${rows[-1]}"
    rm -rf "$venv"
done

{
    echo "| torch | timm | torchvision | peft | huggingface_hub | \`pytest -q\` | minutes (install + tests) |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    printf '%s\n' "${rows[@]}"
} | tee "$table"
