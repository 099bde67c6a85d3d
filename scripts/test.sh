#!/usr/bin/env bash
# The test suite on 8 simulated CPU devices (slow tests included; add -m "not slow"
# to skip them locally). Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
"$VENV/bin/python" -c "import jax, flax, optax, sys; print(f\"python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}\")"
exec "$VENV/bin/python" -m pytest "$@"
