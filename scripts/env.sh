# Sourced by demo.sh and test.sh: create or reuse .venv and install sbpjax with
# the extras for tests and plots from pyproject.toml (re-installed only when
# pyproject.toml changes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.sbpjax-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test,plots]"
  echo "$want" > "$stamp"
fi
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
