#!/usr/bin/env bash
# The README's demo, from a fresh checkout: leases by hand, then two run_lease_worker processes,
# one killed with SIGKILL mid-job and its job taken over after the lease; a summary table and
# how to open the admin. SQLite by default (example_project/shop.sqlite3, or SHOP_SQLITE);
# DATABASE_URL=postgres://user@host:port/db for PostgreSQL. Exits non-zero if the takeover
# does not happen. Extra arguments go to `manage.py lease_tour` (--steps, --workers, --lease).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../tests/bootstrap.sh"
leases_venv
export SHOP_SQLITE=${SHOP_SQLITE:-$here/shop.sqlite3}
cd "$here"
"$LEASES_VENV_PYTHON" manage.py migrate --verbosity 0
"$LEASES_VENV_PYTHON" manage.py lease_tour "$@"
