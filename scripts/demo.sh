#!/usr/bin/env bash
# The main demo: every 1-D and 2-D boxing on a 2x4 placement, with plans and checks.
# Extra arguments go to the demo (e.g. --quick).
source "$(dirname "$0")/env.sh"
exec .venv/bin/python examples/boxing_tour.py "$@"
