#!/usr/bin/env bash
# Run the whole test suite on a fresh machine (CPU is enough: Triton kernels run under TRITON_INTERPRET=1).
# Sets up ./.venv (scripts/setup.sh), installs headless Chromium for the demo's browser test when it can,
# then runs pytest. Exit code: pytest's, with "no tests collected" (5) treated as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,demo bash scripts/setup.sh || exit 1
. .venv/bin/activate
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped"
fi
mkdir -p test-artifacts
# one pytest worker per CPU core (pytest-xdist), whole test files per worker (a file's shared set-up runs once)
python -m pytest -q -rs --durations=10 -n auto --dist loadfile "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
