"""With psycopg's prepared statements on, as a project without a transaction pooler may set
them (OPTIONS server_side_binding and prepare_threshold; docs/databases.md): the statements
the worker and enqueue send are prepared, and tests/run.sh's prepared pass runs the verbs,
the backend and real workers that way. Outside that pass, this module checks nothing.

Invariants (design.md): (2) rowcount is ownership and (3) nothing is half-written hold for a
prepared claim, ack and enqueue as for the statements Django sends by default: the same
tests run in both passes.
"""

from __future__ import annotations

import os

import pytest
from django.db import connection

from django_leases.models import Job
from tests.procs import current_database_url
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db

PREPARED_PASS = os.environ.get("LEASES_EXPECT_PREPARED") == "1"


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.skipif(not PREPARED_PASS, reason="tests/run.sh's prepared pass only")
def test_the_prepared_pass_prepares_the_claim_the_ack_and_the_enqueue():
    """The pass has the mode on (else it would test Django's default twice), its worker
    processes too, and a claim, an ack riding with a claim and an enqueue are prepared
    statements of the session that sent them."""
    assert connection.vendor == "postgresql"
    assert connection.settings_dict["OPTIONS"].get("server_side_binding") is True
    assert connection.settings_dict["OPTIONS"].get("prepare_threshold") == 0
    # The worker processes the tests start get the same options (tests/procs.py).
    assert current_database_url().endswith("?server_side_binding=true&prepare_threshold=0")
    for n in range(12):  # six claimed alone, six riding with the acks
        add.enqueue(n, n)
    for _ in range(6):
        claimed = Job.objects.claim_rows("w", ["default"], limit=1, settle=False)
        assert len(claimed) == 1
        acked, _ = Job.objects.ack_and_claim_rows([(claimed[0], 1)], "w", ["default"], limit=1)
        assert acked == {claimed[0].pk}
    statements = prepared_statements()
    assert any("INSERT INTO" in s and "RETURNING id, enqueued_at" in s for s in statements), (
        statements
    )
    assert any("due AS MATERIALIZED" in s and "acked AS" not in s for s in statements), statements
    assert any("WITH acked AS" in s for s in statements), statements
