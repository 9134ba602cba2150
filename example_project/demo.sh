#!/usr/bin/env bash
# The README's demo: a lease tour on SQLite (the embedded default), from a fresh checkout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../tests/bootstrap.sh"
leases_venv
export SHOP_SQLITE=${SHOP_SQLITE:-$here/shop.sqlite3}
cd "$here"
"$LEASES_VENV_PYTHON" manage.py migrate --verbosity 0
"$LEASES_VENV_PYTHON" manage.py lease_tour "$@"
