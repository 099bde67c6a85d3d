#!/usr/bin/env bash
# Build the documentation site strictly (a broken link, reference or docstring
# fails the build) into site/. Uses the environment of scripts/env.sh and adds
# the docs extra of pyproject.toml to it (re-installed only when pyproject.toml
# changes). Extra arguments go to mkdocs build (e.g. --site-dir /tmp/site).
# Preview while writing: .venv/bin/mkdocs serve
source "$(dirname "$0")/env.sh"
ensure_extra docs
export NO_MKDOCS_2_WARNING=1   # mkdocs-material's notice about its successor
exec "$VENV/bin/python" -m mkdocs build --strict "$@"
