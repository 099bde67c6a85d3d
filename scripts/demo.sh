#!/usr/bin/env bash
# The main demo: a GPT-2-style model trained on 8 devices with a data x tensor (2x4)
# layout given by a few annotations (examples/gpt_hybrid.py). Extra arguments go
# to the demo (e.g. --steps 100). The boxing tour: python examples/boxing_tour.py.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/python" examples/gpt_hybrid.py "$@"
