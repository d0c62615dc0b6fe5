# The one bootstrap of the project's virtualenv, sourced by scripts/test, scripts/demo and
# scripts/bench (run from the repository's top folder).
#
# ensure_venv CALLER EXTRAS makes .venv with python3 ($PYTHON), installing python3 and
# python3-venv with apt on a bare machine, then installs the project editable with EXTRAS
# (comma-separated) unless a stamp says these very setup.cfg and pyproject.toml are installed
# with those extras already, or with test,all, which covers every other set.

ensure_venv() {
  local caller=$1 extras=$2 python=${PYTHON:-python3} hash
  if ! command -v "$python" >/dev/null; then
    echo "$caller: $python not found; installing python3 with apt" >&2
    apt-get update -q && apt-get install -y -q python3 python3-venv
  fi
  if [ ! -x .venv/bin/python ]; then
    if ! "$python" -m venv .venv; then
      echo "$caller: venv unavailable; installing python3-venv with apt" >&2
      rm -rf .venv
      apt-get update -q && apt-get install -y -q python3-venv
      "$python" -m venv .venv
    fi
  fi
  hash=$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)
  if [ -f ".venv/.installed-$extras-$hash" ] || [ -f ".venv/.installed-test,all-$hash" ]; then
    return 0
  fi
  echo "$caller: installing mesh-runtime[$extras] into .venv (pip's output: .venv/pip.log)" >&2
  if ! { .venv/bin/python -m pip install -q --upgrade pip &&
         .venv/bin/python -m pip install -q -e ".[$extras]"; } >.venv/pip.log 2>&1; then
    cat .venv/pip.log >&2
    return 1
  fi
  rm -f .venv/.installed-*
  touch ".venv/.installed-$extras-$hash"
}
