"""Deleting finished jobs past retention, in short batches that never wait for a worker.

The jobs go with a raw DELETE, which is what makes pruning millions of rows cheap; what points
at a job is followed here as Django's collector would follow it, or a foreign key would refuse
the DELETE. This app's relations: failures and effects are deleted, a schedule run record is
unlinked, a schedule's last job is kept. A project's own models, by their ``on_delete``:

- ``PROTECT``, ``RESTRICT``, and ``DO_NOTHING`` under a foreign key constraint: the job is
  kept (Django's delete would refuse it, or the database would), and pruned once nothing
  points at it any more;
- ``CASCADE``, ``SET_NULL``, ``SET_DEFAULT``, ``SET(...)``: the jobs pointed at are deleted
  through Django's collector (``QuerySet.delete()``, signals included), the rest of the batch
  raw;
- ``DB_CASCADE``, ``DB_SET_NULL``, ``DB_SET_DEFAULT``, and ``DO_NOTHING`` without a
  constraint: nothing to do, the database follows them or nothing is there to refuse.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.models import Q, Value
from django.db.models.deletion import ProtectedError, RestrictedError
from django.db.models.functions import Now

from .states import TERMINAL_STATES, JobState

if TYPE_CHECKING:
    from .models import Job

    # For the type checker the mixin is the queryset it is mixed into (see operators.py).
    _VerbsBase = models.QuerySet[Job]
else:
    _VerbsBase = object

# Django 6.1's database-level on_delete (DB_CASCADE, ...): the database follows them.
_DATABASE_ON_DELETE: Any = getattr(models.deletion, "DatabaseOnDelete", ())
_KEEPING = (models.PROTECT, models.RESTRICT)


class PruneVerbs(_VerbsBase):
    """prunable() and prune() of JobQuerySet (a mixin, as OperatorVerbs)."""

    if TYPE_CHECKING:
        _db: str | None

    def prunable(self, older_than_days: float, *, include_dead: bool = False) -> Any:
        """Finished jobs past retention: succeeded, cancelled, and dead ones if asked; not
        a schedule's last job, which the schedule still names (its next tick replaces it),
        nor a job a project's model protects (PROTECT, RESTRICT, DO_NOTHING under a foreign
        key constraint)."""
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        named = self._schedules().filter(last_job__isnull=False).values("last_job")
        return (
            self.filter(
                state__in=states, finished_at__lt=Now() - Value(timedelta(days=older_than_days))
            )
            .exclude(pk__in=named)
            .exclude(self._kept_by_projects(self._db or router.db_for_read(self.model)))
        )

    def prune(
        self, older_than_days: float, *, include_dead: bool = False, batch_size: int = 1000
    ) -> int:
        """Delete finished jobs (succeeded and cancelled, and dead ones if asked) that finished
        more than N days ago on the database clock, with their failures and effects; return
        how many jobs were deleted. A deleted job's schedule run record is unlinked (set NULL,
        as its on_delete says; the records go with ScheduleRun.objects.prune()). A schedule's
        last job stays: unlinking it would write to schedule rows the workers' tick decisions
        lock, and prune never waits for a worker. A project's models pointing at jobs are
        followed by their on_delete (the module's docstring): the jobs they point at go
        first, each batch through Django's collector; then the rest.

        Each batch of ``batch_size`` is its own short transaction that locks only finished
        jobs past retention and the history of those it deletes, taken with SKIP LOCKED where
        the database has it, and re-checks the state and the age in the DELETE itself: a job
        requeued by an operator in the meantime is pending again and stays. Batches walk each
        state's (state, finished_at) index in order from where the last one stopped, so no
        batch rescans what its predecessors deleted.
        """
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        db = self._db or router.db_for_write(self.model)
        followed, _ = self._project_references()
        deleted = 0
        for state in states:
            if followed:
                deleted += self._prune_followed(db, state, older_than_days, batch_size)
            after: Any = None
            while True:
                n, after = (
                    self._prune_batch_pg(db, state, older_than_days, after, batch_size)
                    if connections[db].vendor == "postgresql"
                    else self._prune_batch(db, state, older_than_days, after, batch_size)
                )
                deleted += n
                if n == 0 or after is None:
                    break
        return deleted

    def _old(self, db: str, state: str, days: float) -> Any:
        """Jobs of ``state`` past retention, not a schedule's last job (read without a lock:
        only a new job ever becomes one, so a list read a moment ago keeps every job it
        must)."""
        return (
            self.filter(state=state, finished_at__lt=Now() - Value(timedelta(days=days)))
            .exclude(pk__in=self._named_by_schedules(db))
            .using(db)
        )

    def _prune_batch(
        self, db: str, state: str, days: float, after: Any, batch_size: int
    ) -> tuple[int, Any]:
        """One batch through the ORM, of jobs no project's model points at: (jobs deleted,
        the last finished_at seen)."""
        old = self._old(db, state, days).exclude(self._pointed_at_by_projects(db))
        if after is not None:
            old = old.filter(finished_at__gte=after)
        with transaction.atomic(using=db):
            rows = list(
                self._locked(db, old)
                .order_by("finished_at", "pk")
                .values_list("pk", "finished_at")[:batch_size]
            )
            if not rows:
                return 0, None
            doomed = self._still_old(db, [pk for pk, _ in rows], state, days)
            for rel in self._own_references():
                linked = rel.related_model._default_manager.using(db).filter(
                    **{f"{rel.field.name}__in": doomed}
                )
                if rel.on_delete is models.CASCADE:
                    linked.delete()
                else:
                    linked.update(**{rel.field.name: None})
            # One DELETE with the predicate: what pointed at the jobs is gone or unlinked,
            # so there is nothing left to collect.
            deleted: int = doomed._raw_delete(db)
        return deleted, rows[-1][1]

    def _prune_followed(self, db: str, state: str, days: float, batch_size: int) -> int:
        """Delete, through Django's collector (``QuerySet.delete()``), the jobs of ``state``
        past retention that a project's model follows (CASCADE, SET_NULL, ...), in batches
        walked in primary-key order; answer how many went. A job the collector refuses (a
        model further along protects what would cascade) is kept, the others go."""
        pointed = self._pointed_at_by_projects(db, followed_only=True)
        label = self.model._meta.label
        deleted = 0
        last: Any = None
        while True:
            old = self._old(db, state, days).filter(pointed)
            if last is not None:
                old = old.filter(pk__gt=last)
            with transaction.atomic(using=db):
                ids = list(
                    self._locked(db, old).order_by("pk").values_list("pk", flat=True)[:batch_size]
                )
                if not ids:
                    return deleted
                last = ids[-1]
                try:
                    with transaction.atomic(using=db):
                        doomed = self._still_old(db, ids, state, days)
                        deleted += doomed.delete()[1].get(label, 0)
                except (ProtectedError, RestrictedError):
                    for pk in ids:
                        try:
                            with transaction.atomic(using=db):
                                doomed = self._still_old(db, [pk], state, days)
                                deleted += doomed.delete()[1].get(label, 0)
                        except (ProtectedError, RestrictedError):
                            pass

    @staticmethod
    def _locked(db: str, jobs: Any) -> Any:
        """``jobs`` locked as they are read, skipping what others hold, where the database
        can."""
        if connections[db].features.has_select_for_update_skip_locked:
            return jobs.select_for_update(skip_locked=True)
        return jobs

    def _still_old(self, db: str, ids: list[Any], state: str, days: float) -> Any:
        """The jobs of ``ids`` still of ``state`` and past retention, and not a schedule's
        last job: read again once the rows are locked, for a retention shorter than the
        moment since the first read. The condition goes into each DELETE itself, so a job
        requeued since the read is pending again and stays, history and all."""
        named = self._named_by_schedules(db)
        return self.model._default_manager.using(db).filter(
            pk__in=[pk for pk in ids if pk not in named],
            state=state,
            finished_at__lt=Now() - Value(timedelta(days=days)),
        )

    def _kept_by_projects(self, db: str) -> Q:
        """The jobs a project's model protects, as a condition."""
        return self._pointed_at(db, self._project_references()[1])

    def _pointed_at_by_projects(self, db: str, *, followed_only: bool = False) -> Q:
        """The jobs a project's model points at, by a relation prune must follow or keep
        (or only follow), as a condition."""
        followed, keeping = self._project_references()
        return self._pointed_at(db, followed if followed_only else followed + keeping)

    @staticmethod
    def _pointed_at(db: str, rels: list[Any]) -> Q:
        """The jobs the rows of ``rels`` point at, as a condition (empty: none)."""
        condition = Q()
        for rel in rels:
            name = rel.field.name
            rows = rel.related_model._base_manager.using(db).filter(**{f"{name}__isnull": False})
            condition |= Q(**{f"{rel.field_name}__in": rows.values(name)})
        return condition

    def _project_references(self) -> tuple[list[Any], list[Any]]:
        """Other apps' relations pointing at a job: (followed through the collector,
        keeping their jobs). Relations the database follows itself are in neither."""
        meta = self.model._meta
        followed: list[Any] = []
        keeping: list[Any] = []
        for rel in meta.get_fields(include_hidden=True):
            if not (
                isinstance(rel, models.ForeignObjectRel)
                and (rel.one_to_many or rel.one_to_one)
                and rel.related_model._meta.app_label != meta.app_label
            ):
                continue
            on_delete = rel.on_delete
            if on_delete in _KEEPING or (
                on_delete is models.DO_NOTHING and getattr(rel.field, "db_constraint", False)
            ):
                keeping.append(rel)
            elif on_delete is not models.DO_NOTHING and not isinstance(
                on_delete, _DATABASE_ON_DELETE
            ):
                followed.append(rel)
        return followed, keeping

    def _schedules(self) -> Any:
        """The Schedule model's manager: schedules name their last job."""
        meta = (self.model._meta.concrete_model or self.model)._meta
        return apps.get_model(meta.app_label, "Schedule")._default_manager

    def _named_by_schedules(self, db: str) -> set[Any]:
        """The ids of the jobs schedules name as their last job (one per schedule)."""
        last = self._schedules().using(db).filter(last_job__isnull=False)
        return set(last.values_list("last_job", flat=True))

    def _own_references(self) -> list[Any]:
        """This app's relations pointing at a job that a raw DELETE must follow as Django's
        collector would, or the foreign keys refuse it: failures and effects (CASCADE,
        deleted with it) and a schedule's run record (SET_NULL, unlinked). Not a
        schedule's last job: prune keeps that job (prunable())."""
        meta = (self.model._meta.concrete_model or self.model)._meta
        schedule = self._schedules().model
        rels = [
            f
            for f in meta.get_fields(include_hidden=True)
            if isinstance(f, models.ForeignObjectRel)
            and (f.one_to_many or f.one_to_one)
            and f.related_model._meta.app_label == meta.app_label
            and f.related_model is not schedule
        ]
        for rel in rels:
            if rel.on_delete not in (models.CASCADE, models.SET_NULL):
                raise TypeError(f"prune cannot follow on_delete of {rel.field}")
        return rels

    def _prune_batch_pg(
        self, db: str, state: str, days: float, after: Any, batch_size: int
    ) -> tuple[int, Any]:
        """One batch on PostgreSQL, one statement: pick the oldest rows of ``state`` past
        retention, no schedule's last job and none a project's model points at (an ordered
        scan of leases_job_finished_idx, SKIP LOCKED: a lock on the jobs only, never on the
        schedules it reads), delete their failures and effects, unlink their schedule run
        records, then delete the jobs. Autocommit makes it its own transaction."""
        quote = connections[db].ops.quote_name
        job = self.model._meta
        schedule = self._schedules().model._meta
        last = quote(schedule.get_field("last_job").column)
        # A job a project's model points at is left to _prune_followed() or kept.
        followed, keeping = self._project_references()
        pointed = "".join(
            f"""
              AND NOT EXISTS (
                SELECT 1 FROM {quote(rel.related_model._meta.db_table)} r
                WHERE r.{quote(rel.field.column)} = j.{quote(rel.field.target_field.column)}
              )"""
            for rel in followed + keeping
        )
        references = ""
        for n, rel in enumerate(self._own_references()):
            table = quote(rel.related_model._meta.db_table)
            column = quote(rel.field.column)
            change = (
                f"DELETE FROM {table}"
                if rel.on_delete is models.CASCADE
                else f"UPDATE {table} SET {column} = NULL"
            )
            references += f"""
        , linked_{n} AS (
            {change} WHERE {column} = ANY(ARRAY(SELECT id FROM doomed))
        )"""
        sql = f"""
        WITH doomed AS (
            SELECT j.id, j.finished_at FROM {quote(job.db_table)} j
            WHERE j.state = %(state)s
              AND j.finished_at < statement_timestamp() - make_interval(secs => %(secs)s)
              {"AND j.finished_at >= %(after)s" if after is not None else ""}
              -- One array for the statement (one id per schedule), whatever the plan.
              AND j.id <> ALL(ARRAY(
                SELECT {last} FROM {quote(schedule.db_table)} WHERE {last} IS NOT NULL
              )){pointed}
            ORDER BY j.finished_at
            LIMIT %(limit)s
            FOR UPDATE OF j SKIP LOCKED
        ){references}
        , jobs AS (
            -- ids as an array: primary-key lookups, never a join planned as a scan of the
            -- whole table.
            DELETE FROM {quote(job.db_table)}
            WHERE id = ANY(ARRAY(SELECT id FROM doomed)) AND state = %(state)s
            RETURNING finished_at
        )
        SELECT count(*), max(finished_at) FROM jobs
        """
        params = {"state": state, "secs": days * 86400, "after": after, "limit": batch_size}
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            cursor.execute(sql, params)
            n, last = cursor.fetchone()
        return n, last
