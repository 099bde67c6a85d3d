#!/usr/bin/env bash
# Lint, format and type checks as configured in pyproject.toml: ruff check,
# ruff format --check, mypy (basic mode, over sbpjax/). Uses the environment of
# scripts/env.sh and adds the lint extra to it (re-installed only when
# pyproject.toml changes). Every check runs; the exit status is non-zero if any
# failed. To fix what can be fixed automatically: ruff check --fix . && ruff format .
source "$(dirname "$0")/env.sh"
ensure_extra lint
status=0
"$VENV/bin/ruff" check . || status=1
"$VENV/bin/ruff" format --check . || status=1
"$VENV/bin/mypy" || status=1
exit $status
