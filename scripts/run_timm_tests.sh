#!/usr/bin/env bash
# Run timm's own model tests (tests/test_models.py of a timm source checkout) on the registered gspn2 models.
#
#   bash scripts/run_timm_tests.sh /path/to/pytorch-image-models [extra pytest args]
#   bash scripts/run_timm_tests.sh ~/src/pytorch-image-models -k "gspn2_micro and fx"
#
# timm's tests are not part of this repository: they run from the given checkout, against the installed
# timm, with scripts/timm_test_plugin.py loaded first (it imports gspn2, which registers the models, and
# adds gspn2 to the families timm's forward_intermediates tests select). -k gspn2 is always applied, so
# only gspn2 models run; a -k of your own narrows it further. PYTHON picks the interpreter
# (default: .venv/bin/python of this repository, else python).
set -euo pipefail

if [[ $# -lt 1 || ! -f "$1/tests/test_models.py" ]]; then
    echo "usage: $0 TIMM_CHECKOUT [pytest args]   (TIMM_CHECKOUT must contain tests/test_models.py)" >&2
    exit 2
fi
timm_src="$(cd "$1" && pwd)"
shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python; fi
fi

# Our own -k is combined with the caller's: pytest keeps only the last -k, so merge them here.
keyword="gspn2"
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -k) keyword="gspn2 and ($2)"; shift 2 ;;
        -k*) keyword="gspn2 and (${1#-k})"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

cd "$timm_src"
PYTHONPATH="$repo:$repo/scripts${PYTHONPATH:+:$PYTHONPATH}" \
    exec "$python" -m pytest -p timm_test_plugin tests/test_models.py -k "$keyword" -p no:cacheprovider "${args[@]}"
