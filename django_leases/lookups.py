"""``icontains`` that ignores case on MySQL and MariaDB too, for the columns that compare as
spelled there.

Django's ``icontains`` is a plain ``LIKE`` on MySQL and MariaDB, so it follows the column's
collation: the binary one migration 0009 gives names, ids and keys (so that they compare as
spelled) made it case-sensitive there alone, the admin's search of schedules and workers
with it. On those columns it lowers both sides there; elsewhere it is Django's own.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model
from django.db.models.lookups import IContains


class CaseBlindContains(IContains):
    """``icontains``, both sides lowered on MySQL and MariaDB."""

    def as_mysql(self, compiler: Any, connection: Any) -> tuple[str, Any]:
        if not self.rhs_is_direct_value():
            # An expression: Django's own pattern wrapping, as on the default collation.
            return super().as_sql(compiler, connection)
        lhs, params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"LOWER({lhs}) LIKE LOWER({rhs})", [*params, *rhs_params]


def case_blind(model: type[Model], *names: str) -> None:
    """Make ``icontains`` on ``model``'s fields ``names`` ignore case on every database
    (registered on those fields alone, not on every CharField)."""
    for name in names:
        field: Any = model._meta.get_field(name)
        field.register_lookup(CaseBlindContains)
