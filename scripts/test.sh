#!/usr/bin/env bash
# The test suite on 8 simulated CPU devices (slow tests included; add -m "not slow"
# to skip them locally). Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
exec .venv/bin/python -m pytest "$@"
