from __future__ import annotations

import pytest


@pytest.fixture
def workers(tmp_path):
    """Start real run_lease_worker processes; whatever is left is killed at teardown."""
    from tests.worker_helpers import Workers

    pool = Workers(tmp_path)
    yield pool
    pool.close()
