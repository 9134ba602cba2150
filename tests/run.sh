#!/usr/bin/env bash
# Run the test suite on SQLite and on PostgreSQL (never skipped: an unreachable server fails).
#   bash tests/run.sh                 both databases
#   LEASES_DATABASES=sqlite bash tests/run.sh
#   DATABASE_URL=postgres://user@host:5432/db bash tests/run.sh -k claim    (that database only)
#   LEASES_EXTRAS=test,mysql LEASES_DATABASES="mysql" bash tests/run.sh    (MariaDB/MySQL)
#   LEASES_DATABASES=pgbouncer bash tests/run.sh   PostgreSQL through a PgBouncer of its own in
#     transaction pooling (tests/pooler.py): the tests of the verbs, the workers, fencing, the
#     admin, and the chaos short profile. Skipped without pgbouncer, unless
#     LEASES_REQUIRE_PGBOUNCER=1 (CI): then it fails.
#   LEASES_DATABASES=prepared bash tests/run.sh    PostgreSQL with psycopg's server-side binding
#     and every statement prepared (OPTIONS server_side_binding, prepare_threshold 0): the
#     tests of the verbs, enqueue, the backend, the admin and the workers, and a check that
#     statements are prepared.
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
# The tests that run through the pooler: every statement a worker, the backend, fencing and
# the admin send, with real workers; and the chaos short profile (tests/test_chaos.py).
# LEASES_POOLED_TESTS="tests/test_x.py ..." runs others instead.
pooled_tests=(${LEASES_POOLED_TESTS:-tests/test_pooler.py tests/test_query.py tests/test_fencing.py
  tests/test_backend.py tests/test_admin.py tests/test_advisor.py tests/test_worker_process.py
  tests/test_worker_fencing.py tests/test_worker_heartbeat.py tests/test_chaos.py})

# PostgreSQL through a PgBouncer started here. Django's test database is made through it (its
# CREATE DATABASE is one autocommit statement) and kept (--reuse-db): dropping it through the
# pooler would fail while PgBouncer holds server sessions on it, so it is dropped here, directly.
pooled() {
  local target=${pg_url#*://}; target=${target#*@}; target=${target%%/*}
  local dir name=${LEASES_TEST_DB_NAME:-test_leases}_pooled port
  if ! "$LEASES_VENV_PYTHON" -c 'import sys, tests.pooler as p; sys.exit(not p.available())'; then
    "$LEASES_VENV_PYTHON" -c 'import tests.pooler as p; print(p.MISSING)'
    [ "${LEASES_REQUIRE_PGBOUNCER:-}" = 1 ] && return 1
    echo "SKIPPED: the tests through PgBouncer"; return 0
  fi
  dir=$(mktemp -d)
  # Stopped however this script ends (a timeout, ^C), not only after pytest.
  trap '"$LEASES_VENV_PYTHON" -m tests.pooler stop "'"$dir"'"' EXIT
  port=$("$LEASES_VENV_PYTHON" -m tests.pooler start "$dir" --target "$target") || return 1
  "$LEASES_VENV_PYTHON" -m tests.pooler dropdb "$name" "${name}_queue" --target "$target"
  local rc=0
  DATABASE_URL=postgres://postgres@127.0.0.1:$port/${pg_url##*/} LEASES_TEST_DB_NAME=$name \
    LEASES_POOLER_DIRECT_URL=$pg_url \
    "$LEASES_VENV_PYTHON" -m pytest -p no:cacheprovider --reuse-db "${pooled_tests[@]}" "$@" || rc=$?
  "$LEASES_VENV_PYTHON" -m tests.pooler stop "$dir"
  trap - EXIT
  "$LEASES_VENV_PYTHON" -m tests.pooler dropdb "$name" "${name}_queue" --target "$target" || rc=1
  return $rc
}

# The tests that run with prepared statements (LEASES_PREPARED_TESTS="..." runs others instead).
prepared_tests=(${LEASES_PREPARED_TESTS:-tests/test_prepared.py tests/test_query.py
  tests/test_explain.py tests/test_backend.py tests/test_tasks_api.py tests/test_testing.py
  tests/test_enqueue_hostile.py tests/test_hostile_handlers.py tests/test_dead_letters.py
  tests/test_fencing.py tests/test_worker_process.py tests/test_worker_fencing.py
  tests/test_worker_heartbeat.py tests/test_worker_stopping.py tests/test_admin.py
  tests/test_schedules_db.py})

status=0
for db in ${LEASES_DATABASES:-sqlite postgres}; do
  case $db in
    sqlite) url="sqlite:///${TMPDIR:-/tmp}/django-leases-tests-$$.sqlite3" ;;
    postgres) url=$pg_url ;;
    mysql) url=$mysql_url ;;
    prepared)
      # Every statement prepared at its first run on a connection (prepare_threshold 0), so
      # that short-lived worker processes send prepared statements too.
      echo "=== tests on PostgreSQL with prepared statements ($("$LEASES_VENV_PYTHON" -V)) ==="
      sep='?'; [[ $pg_url == *'?'* ]] && sep='&'
      DATABASE_URL="$pg_url${sep}server_side_binding=true&prepare_threshold=0" LEASES_EXPECT_PREPARED=1 \
        LEASES_TEST_DB_NAME=${LEASES_TEST_DB_NAME:-test_leases}_prepared \
        "$LEASES_VENV_PYTHON" -m pytest -p no:cacheprovider "${prepared_tests[@]}" "$@" || status=$?
      continue ;;
    pgbouncer)
      echo "=== tests on PostgreSQL through PgBouncer, transaction pooling ($("$LEASES_VENV_PYTHON" -V)) ==="
      pooled "$@" || status=$?
      continue ;;
    *) url=$db ;;
  esac
  echo "=== tests on $db ($("$LEASES_VENV_PYTHON" -V)) ==="
  DATABASE_URL=$url "$LEASES_VENV_PYTHON" -m pytest -p no:cacheprovider "$@" || status=$?
done
exit $status
