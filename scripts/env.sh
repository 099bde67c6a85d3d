# Sourced by demo.sh and test.sh: create or reuse a virtual environment and
# install sbpjax with the extras for tests and plots from pyproject.toml
# (re-installed only when pyproject.toml changes).
#
# PYTHON picks the interpreter (default python3, whose environment is .venv);
# any other gets its own environment, .venv-py<major.minor>, so the two
# supported ends (Python 3.11 with jax 0.10.2, Python 3.12+ with the newest
# jax) live side by side: PYTHON=python3.12 bash scripts/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import sys" >/dev/null 2>&1; then
  echo "scripts/env.sh: cannot run PYTHON=$PY" >&2
  exit 2
fi
if [ -z "${PYTHON:-}" ]; then
  VENV=.venv
else
  VENV=.venv-py$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.sbpjax-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)

# install_editable EXTRAS: sbpjax from this tree with the optional-dependency
# groups EXTRAS ("test,plots"), by uv where it can be had, else by pip.
# Decision: uv (a pip-compatible installer, itself one wheel from the package
# index) resolves and installs the environment in 8-11 s where pip takes 99 s
# on a 2-core machine (jax, flax, optax, the test, plot, lint and docs extras;
# its cache warm or cold alike), and both CI legs and every fresh clone pay it.
# Nothing of sbpjax depends on uv: when it cannot be installed or fails (an
# index only pip's own configuration reaches, say), pip does the same install.
# SBPJAX_PIP=1 uses pip throughout. Like PIP_NO_COMPILE, uv writes no bytecode
# at install time; each module is compiled once when first imported.
install_editable() {
  local extras=$1
  if [ -z "${SBPJAX_PIP:-}" ]; then
    local uv
    uv=$(command -v uv || true)
    if [ -z "$uv" ] && "$VENV/bin/python" -m pip install --quiet uv >/dev/null 2>&1; then
      uv=$VENV/bin/uv
    fi
    if [ -n "$uv" ] && "$uv" pip install --quiet --no-progress --python "$VENV/bin/python" -e ".[$extras]"; then
      return
    fi
    echo "scripts/env.sh: uv could not install; installing with pip" >&2
  fi
  "$VENV/bin/python" -m pip install --quiet -e ".[$extras]"
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  install_editable "test,plots"
  echo "$want" > "$stamp"
fi
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"

# ensure_extra NAME...: add the optional-dependency groups NAME... of pyproject.toml
# to this environment, those missing in one pip call (re-installed only when
# pyproject.toml changes).
ensure_extra() {
  local name missing=()
  for name in "$@"; do
    local stamp="$VENV/.sbpjax-$name-installed"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
      missing+=("$name")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    # with the base extras again, so that the resolver keeps what they installed
    install_editable "test,plots,$(IFS=,; echo "${missing[*]}")"
    for name in "${missing[@]}"; do
      echo "$want" > "$VENV/.sbpjax-$name-installed"
    done
  fi
}
