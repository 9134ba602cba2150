# Sourced by tests/run.sh and example_project/demo.sh: find a Python >= 3.12 and a virtualenv
# in .venv with django-leases installed from pyproject.toml (extras in LEASES_EXTRAS).
# LEASES_PYTHON=/path/to/python picks the interpreter; LEASES_VENV moves the virtualenv;
# LEASES_DJANGO="django>=6.0,<6.1" pins another Django into it.

leases_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

leases_find_python() {
  local cand
  local -a cands=()
  [ -n "${LEASES_PYTHON:-}" ] && cands+=("$LEASES_PYTHON")
  cands+=(python3.13 python3.12 python3.14 python3)
  if command -v pyenv >/dev/null 2>&1; then
    cands+=("$(pyenv root)"/versions/3.1[2-9]*/bin/python3)
  fi
  cands+=("$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9])
  for cand in "${cands[@]}"; do
    # A pyenv shim answers to the name but fails when that version is not selected: ask it.
    if "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      "$cand" -c 'import sys; print(sys.executable)'
      return 0
    fi
  done
  echo "django-leases needs Python 3.12 or newer (Django 6); none found." >&2
  echo "Install python3.12 or set LEASES_PYTHON=/path/to/python3.12." >&2
  return 1
}

leases_venv() {
  # The virtualenv is rebuilt only when the interpreter, the Django pin or pyproject.toml
  # changed; extras another command needs are added to it, never swapped for, so the README's
  # commands (demo, tests, docs) share one .venv instead of wiping each other's.
  local extras=${LEASES_EXTRAS:-test} python venv stamp want have installed union
  venv=${LEASES_VENV:-$leases_root/.venv}
  python=$(leases_find_python) || return 1
  want="$python ${LEASES_DJANGO:+$LEASES_DJANGO }$(cksum < "$leases_root/pyproject.toml")"
  stamp="$venv/.leases-stamp"
  have=$(sed -n 1p "$stamp" 2>/dev/null || true)
  installed=$(sed -n 2p "$stamp" 2>/dev/null || true)
  if [ ! -x "$venv/bin/python" ] || [ "$have" != "$want" ]; then
    echo "Setting up $venv with $("$python" -V) ..." >&2
    rm -rf "$venv"
    "$python" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2 || return 1
    installed=""
  fi
  union=$(printf '%s\n' ${installed//,/ } ${extras//,/ } | sort -u | paste -sd, -)
  if [ "$union" != "$installed" ] || [ "$have" != "$want" ]; then
    echo "Installing django-leases[$union] into $venv ..." >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$leases_root[$union]" >&2 || return 1
    if [ -n "${LEASES_DJANGO:-}" ]; then
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "$LEASES_DJANGO" >&2 || return 1
    fi
    printf '%s\n%s\n' "$want" "$union" > "$stamp"
  fi
  LEASES_VENV_PYTHON="$venv/bin/python"
}
