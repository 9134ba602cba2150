#!/usr/bin/env bash
# Run the test suite on SQLite and on PostgreSQL (never skipped: an unreachable server fails).
#   bash tests/run.sh                 both databases
#   LEASES_DATABASES=sqlite bash tests/run.sh
#   DATABASE_URL=postgres://user@host:5432/db bash tests/run.sh -k claim    (that database only)
#   LEASES_EXTRAS=test,mysql LEASES_DATABASES="mysql" bash tests/run.sh    (MariaDB/MySQL)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/bootstrap.sh"
leases_venv
cd "$leases_root"

pg_url=${LEASES_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
mysql_url=${LEASES_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
# tests/test_package.py runs its user project on this server too, from the SQLite pass.
export LEASES_PG_URL=$pg_url
# The chaos suite's skewed workers preload the libfaketime that the test extras built, as the
# clock-skew tests do (LEASES_CHAOS_FAKETIME_LIB=/path/to/libfaketime.so.1 picks another).
if [ -z "${LEASES_CHAOS_FAKETIME_LIB:-}" ]; then
  LEASES_CHAOS_FAKETIME_LIB=$("$LEASES_VENV_PYTHON" -c 'import libfaketime, os
print(os.path.join(os.path.dirname(libfaketime.__file__), "vendor/libfaketime/src/libfaketime.so.1"))' 2>/dev/null) \
    && export LEASES_CHAOS_FAKETIME_LIB
fi
# A DATABASE_URL alone means: that database only.
[ -n "${DATABASE_URL:-}" ] && [ -z "${LEASES_DATABASES:-}" ] && LEASES_DATABASES=$DATABASE_URL
status=0
for db in ${LEASES_DATABASES:-sqlite postgres}; do
  case $db in
    sqlite) url="sqlite:///${TMPDIR:-/tmp}/django-leases-tests-$$.sqlite3" ;;
    postgres) url=$pg_url ;;
    mysql) url=$mysql_url ;;
    *) url=$db ;;
  esac
  echo "=== tests on $db ($("$LEASES_VENV_PYTHON" -V)) ==="
  DATABASE_URL=$url "$LEASES_VENV_PYTHON" -m pytest -p no:cacheprovider "$@" || status=$?
done
exit $status
