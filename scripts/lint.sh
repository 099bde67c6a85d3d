#!/usr/bin/env bash
# Lint, format and type checks as configured in pyproject.toml: ruff check,
# ruff format --check, mypy (basic mode, over sbpjax/). Uses the environment of
# scripts/env.sh and adds the lint extra to it (re-installed only when
# pyproject.toml changes). Every check runs; the exit status is non-zero if any
# failed. To fix what can be fixed automatically: ruff check --fix . && ruff format .
source "$(dirname "$0")/env.sh"
VENV=${VENV:-.venv}
stamp=$VENV/.sbpjax-lint-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install --quiet -e ".[lint]"
  echo "$want" > "$stamp"
fi
status=0
"$VENV/bin/ruff" check . || status=1
"$VENV/bin/ruff" format --check . || status=1
"$VENV/bin/mypy" || status=1
exit $status
