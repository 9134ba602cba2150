#!/usr/bin/env bash
# Run the test suite on SQLite and on PostgreSQL (never skipped: an unreachable server fails).
#   bash tests/run.sh                 both databases
#   LEASES_DATABASES=sqlite bash tests/run.sh
#   DATABASE_URL=postgres://user@host:5432/db bash tests/run.sh -k claim
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/bootstrap.sh"
leases_venv
cd "$leases_root"

pg_url=${LEASES_PG_URL:-${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}}
status=0
for db in ${LEASES_DATABASES:-sqlite postgres}; do
  case $db in
    sqlite) url="sqlite:///${TMPDIR:-/tmp}/django-leases-tests-$$.sqlite3" ;;
    postgres) url=$pg_url ;;
    *) url=$db ;;
  esac
  echo "=== tests on $db ($("$LEASES_VENV_PYTHON" -V)) ==="
  DATABASE_URL=$url "$LEASES_VENV_PYTHON" -m pytest -p no:cacheprovider "$@" || status=$?
done
exit $status
