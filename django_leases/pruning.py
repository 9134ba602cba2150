"""Deleting finished jobs past retention, in short batches that never wait for a worker.

Jobs go with a raw DELETE, which is what makes pruning millions of rows cheap, so what points
at a job is followed here, or a foreign key would refuse the DELETE. This app's relations:
failures and effects are deleted, a schedule run record is unlinked, a schedule's last job is
kept (prune never writes to a schedule row). A project's own models, by their ``on_delete``:

- ``PROTECT``, ``RESTRICT`` (even where Django would let a cascade through), and
  ``DO_NOTHING`` under a foreign key constraint, on a job, on its failures and effects, or
  on the row of a project's subclass of Job: the job is kept (and left out of
  ``prunable()``) until nothing of the kind points at it;
- ``CASCADE``, ``SET_NULL``, ``SET_DEFAULT``, ``SET(...)``, on a job or on its failures and
  effects: those jobs go in batches of their own, where Django's collector applies the
  ``on_delete`` to the project's rows (their signals sent; none for the jobs, as ever). A job
  whose rows the collector or the database refuses (a model further along protects,
  restricts or holds them) is kept, the rest of its batch goes; inside a caller's
  transaction the foreign keys are checked at each batch (its own commit checks them
  otherwise);
- ``DB_CASCADE``, ``DB_SET_NULL``, ``DB_SET_DEFAULT`` and ``DO_NOTHING`` without a
  constraint Django made (``db_constraint=False``, an unmanaged model such as a view):
  nothing to do here; the database follows them, or nothing holds to them.

Only models the routers place on the jobs' database count (``allow_migrate``): one kept on
another database has no table here to read, and no constraint to refuse the DELETE.

Whatever the database still refuses (a row reached through a database-level cascade that
something holds to, a reference committed while the batch ran) sends the batch again, then a
job at a time: a job refused then is kept for this run, the others go. Prune never stops at
a job it cannot delete.

What points at a job is read in prune_references.py; what would be refused is found in
prune_refusals.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import Q, Value
from django.db.models.deletion import ProtectedError, RestrictedError
from django.db.models.functions import Now

from .prune_references import Hop, keeps, pointed_at, project_relations, subclasses, to_follow
from .prune_refusals import ProjectRowsCollector, check_foreign_keys_now, refuse_restricted
from .states import TERMINAL_STATES, JobState

if TYPE_CHECKING:
    from .models import Job

    # For the type checker the mixin is the queryset it is mixed into (see operators.py).
    _VerbsBase = models.QuerySet[Job]
else:
    _VerbsBase = object

# What a project's rows answer when a job they point at cannot go: the job is kept.
_REFUSED = (ProtectedError, RestrictedError, IntegrityError)


class PruneVerbs(_VerbsBase):
    """prunable() and prune() of JobQuerySet (a mixin, as OperatorVerbs)."""

    if TYPE_CHECKING:
        _db: str | None

    def prunable(self, older_than_days: float, *, include_dead: bool = False) -> Any:
        """Finished jobs past retention: succeeded, cancelled, and dead ones if asked; not
        a schedule's last job, which the schedule still names (its next tick replaces it),
        nor a job a project's model protects (PROTECT, RESTRICT, DO_NOTHING under a foreign
        key constraint). A job the collector will refuse (a model further along protects
        what would cascade) is counted here, and kept by prune()."""
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        self._refuse_a_subclass()
        named = self._schedules().filter(last_job__isnull=False).values("last_job")
        # Where the jobs are written, as prune() decides: a replica's alias may be one the
        # routers migrate nothing to.
        db = self._db or router.db_for_write(self.model)
        return (
            self.filter(
                state__in=states, finished_at__lt=Now() - Value(timedelta(days=older_than_days))
            )
            .exclude(pk__in=named)
            .exclude(self._kept_by_projects(db))
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
        first, then the rest.

        Each batch of ``batch_size`` is its own short transaction that locks only finished
        jobs past retention and the history of those it deletes, taken with SKIP LOCKED where
        the database has it, and re-checks the state and the age in the DELETE itself: a job
        requeued by an operator in the meantime is pending again and stays. Batches walk each
        state's (state, finished_at) index in order from where the last one stopped, so no
        batch rescans what its predecessors deleted.
        """
        self._refuse_a_subclass()
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        db = self._db or router.db_for_write(self.model)
        followed = self._project_references(db)[0]
        refused: set[Any] = set()  # jobs the database would not let go: kept this time
        deleted = 0
        for state in states:
            if followed:
                deleted += self._prune_followed(db, state, older_than_days, batch_size)
            after: Any = None
            while True:
                n, after = self._prune_batch_again(
                    db, state, older_than_days, after, batch_size, refused
                )
                deleted += n
                if after is None:  # nothing left to read
                    break
        return deleted

    def _prune_batch_again(
        self,
        db: str,
        state: str,
        days: float,
        after: Any,
        batch_size: int,
        refused: set[Any],
        tries: int = 3,
    ) -> tuple[int, Any]:
        """One batch of jobs no project's model points at, sent again if a foreign key
        refused it (a project's row pointing at one of its jobs committed between the
        batch's read of the project's tables and its delete; the next read sees it), and
        at last a job at a time, so that what the database keeps refusing (a row reached
        through a database-level cascade, say) is kept and the rest goes: (jobs deleted,
        the last finished_at read, None once nothing is left)."""
        batch = (
            self._prune_batch_pg if connections[db].vendor == "postgresql" else self._prune_batch
        )
        while True:
            try:
                return batch(db, state, days, after, batch_size, refused)
            except IntegrityError:
                tries -= 1
                if tries == 0:
                    return self._prune_one_at_a_time(db, state, days, after, batch_size, refused)

    def _prune_one_at_a_time(
        self, db: str, state: str, days: float, after: Any, batch_size: int, refused: set[Any]
    ) -> tuple[int, Any]:
        """The batch _prune_batch() would read, each job in a transaction of its own; a job
        the database refuses joins ``refused`` and stays."""
        rows = list(
            self._unpointed_old(db, state, days, after, refused)
            .order_by("finished_at", "pk")
            .values_list("pk", "finished_at")[:batch_size]
        )
        if not rows:
            return 0, None
        jobs = self._unpointed_old(db, state, days, None, refused)
        deleted, kept = self._delete_each(db, jobs, [pk for pk, _ in rows], state, days)
        refused.update(kept)
        return deleted, rows[-1][1]

    def _delete_each(
        self,
        db: str,
        jobs: Any,
        ids: list[Any],
        state: str,
        days: float,
        *,
        collect: bool = False,
    ) -> tuple[int, list[Any]]:
        """Delete the jobs of ``ids`` still among ``jobs``, each in a transaction of its
        own: (how many went, the ids the collector or the database refused, which stay)."""
        check = connections[db].in_atomic_block
        deleted = 0
        refused = []
        for pk in ids:
            n = 0
            try:
                with transaction.atomic(using=db):
                    if self._locked(db, jobs.filter(pk=pk)).values_list("pk", flat=True):
                        job = self._still_old(db, [pk], state, days)
                        n = self._delete(db, job, collect=collect, check=check)
                deleted += n  # counted once committed
            except _REFUSED:
                refused.append(pk)
        return deleted, refused

    def _unpointed_old(
        self, db: str, state: str, days: float, after: Any, refused: set[Any]
    ) -> Any:
        """The jobs _old() answers that no project's model points at and none refused, from
        ``after`` (a finished_at) on."""
        old = self._old(db, state, days).exclude(self._pointed_at_by_projects(db))
        if refused:
            old = old.exclude(pk__in=refused)
        if after is not None:
            old = old.filter(finished_at__gte=after)
        return old

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
        self, db: str, state: str, days: float, after: Any, batch_size: int, refused: set[Any]
    ) -> tuple[int, Any]:
        """One batch through the ORM, of jobs no project's model points at: (jobs deleted,
        the last finished_at read, None once nothing is left). Inside a caller's
        transaction the foreign keys are checked at the batch, not at the caller's commit."""
        check = connections[db].in_atomic_block
        old = self._unpointed_old(db, state, days, after, refused)
        with transaction.atomic(using=db):
            rows = list(
                self._locked(db, old)
                .order_by("finished_at", "pk")
                .values_list("pk", "finished_at")[:batch_size]
            )
            if not rows:
                return 0, None
            doomed = self._still_old(db, [pk for pk, _ in rows], state, days)
            deleted = self._delete(db, doomed, check=check)
        return deleted, rows[-1][1]

    def _prune_followed(self, db: str, state: str, days: float, batch_size: int) -> int:
        """Delete the jobs of ``state`` past retention that a project's model points at with
        a relation to follow (CASCADE, SET_NULL, ...; on a job or on its history), in
        batches walked in primary-key order; answer how many went. A batch refused (a model
        further along protects what would cascade) goes again a job at a time, each in its
        own transaction, and what is refused then is kept."""
        check = connections[db].in_atomic_block
        deleted = 0
        last: Any = None
        while True:
            old = (
                self._old(db, state, days)
                .filter(self._pointed_at_by_projects(db, followed_only=True))
                .exclude(self._kept_by_projects(db))
            )
            if last is not None:
                old = old.filter(pk__gt=last)
            ids: list[Any] = []
            try:
                with transaction.atomic(using=db):
                    ids = list(
                        self._locked(db, old)
                        .order_by("pk")
                        .values_list("pk", flat=True)[:batch_size]
                    )
                    if not ids:
                        return deleted
                    doomed = self._still_old(db, ids, state, days)
                    n = self._delete(db, doomed, collect=True, check=check)
                deleted += n
            except _REFUSED:
                if not ids:
                    raise
                # What is refused again stays: the walk goes on past it by primary key.
                deleted += self._delete_each(db, old, ids, state, days, collect=True)[0]
            last = ids[-1]

    def _delete(self, db: str, doomed: Any, *, collect: bool = False, check: bool = False) -> int:
        """Delete ``doomed`` (a queryset of jobs, its condition re-checked in each
        statement) with what points at it; answer how many jobs went. With ``collect``,
        Django's collector follows the project's relations and this app's failures and
        effects (with any project's rows pointing at those), never Schedule.last_job. With
        ``check`` (inside a caller's transaction, where each batch is a savepoint) the
        foreign keys are checked before it answers, so that a refusal the database would
        defer to the caller's commit comes here; in its own transaction, the commit says."""
        own = self._own_references()
        histories = [r for r in own if r.on_delete is models.CASCADE]
        unlinked = [r for r in own if r.on_delete is not models.CASCADE]
        if collect:
            job = self.model._meta.concrete_model or self.model
            collector = ProjectRowsCollector(job, using=db, origin=None)
            # The project's rows on the history are reached through the history's.
            direct = [rel for hop, rel in self._project_references(db)[0] if hop is None]
            for rel in direct + histories:
                linked = rel.related_model._base_manager.using(db).filter(
                    **{f"{rel.field.name}__in": doomed}
                )
                rel.on_delete(collector, rel.field, linked, db)
            # The jobs go by the raw DELETE below, after their run records are unlinked;
            # none is collected (ProjectRowsCollector), this only makes sure of it.
            collector.data.pop(job, None)
            refuse_restricted(collector)
            collector.delete()
        for rel in unlinked if collect else own:
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
        if check:
            gone = {self.model, *(r.related_model for r in own)}
            if collect:
                gone.update(collector.data, (qs.model for qs in collector.fast_deletes))
            check_foreign_keys_now(db, gone)
        return deleted

    def _refuse_a_subclass(self) -> None:
        """Raise TypeError for prune through a project's subclass of Job (its manager's
        DELETE would reach its own table, not the jobs'); Job's manager, or a proxy's."""
        if self.model._meta.concrete_model is not apps.get_model("django_leases", "Job"):
            raise TypeError(
                f"prune through Job.objects, not {self.model.__name__}.objects: a subclass "
                "of Job has a table of its own"
            )

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
        moment since the first read. The condition goes into each statement, so a job
        requeued since the read is pending again and stays, history and all."""
        named = self._named_by_schedules(db)
        return self.model._default_manager.using(db).filter(
            pk__in=[pk for pk in ids if pk not in named],
            state=state,
            finished_at__lt=Now() - Value(timedelta(days=days)),
        )

    # -- what points at a job ---------------------------------------------------------------

    def _kept_by_projects(self, db: str) -> Q:
        """The jobs a project's model protects, as a condition (empty: none)."""
        return pointed_at(db, self._project_references(db)[1])

    def _pointed_at_by_projects(self, db: str, *, followed_only: bool = False) -> Q:
        """The jobs a project's model points at, on the job or its history, by a relation
        prune must follow or keep (or only follow), as a condition (empty: none)."""
        followed, keeping = self._project_references(db)
        return pointed_at(db, followed if followed_only else followed + keeping)

    def _pointing_sql(self, db: str) -> list[str]:
        """The same as _pointed_at_by_projects(), as SQL for a job aliased ``j``."""
        quote = connections[db].ops.quote_name
        job_id = quote(str(self.model._meta.pk.column))  # a hop's key holds it
        followed, keeping = self._project_references(db)
        sql = []
        for hop, rel in followed + keeping:
            pointer = quote(rel.related_model._meta.db_table)
            column = f"r.{quote(rel.field.column)}"
            if hop is None:
                target = f"j.{quote(rel.field.target_field.column)}"
                sql.append(f"SELECT 1 FROM {pointer} r WHERE {column} = {target}")
            else:
                between = quote(hop.model._meta.db_table)
                sql.append(
                    f"SELECT 1 FROM {between} h JOIN {pointer} r"
                    f" ON {column} = h.{quote(rel.field.target_field.column)}"
                    f" WHERE h.{quote(hop.key.column)} = j.{job_id}"
                )
        return sql

    def _project_references(self, db: str) -> tuple[list[Any], list[Any]]:
        """Other apps' relations pointing at a job, at its failures and effects (rows this
        app deletes with it), or at a project's subclass of Job, each as (None or the
        Hop between the job and the model pointed at, the relation), from models the
        routers place on ``db``: (those the collector follows, those that keep their
        jobs). Relations the database follows itself, or that nothing holds to, are in
        neither; so are a subclass's relations to follow, which the collector reaches
        through the subclass's own link to its job."""
        followed: list[Any] = []
        keeping: list[Any] = []
        # A proxy's relations are its concrete model's.
        job = self.model._meta.concrete_model or self.model
        histories = [r for r in self._own_references() if r.on_delete is models.CASCADE]
        for hop in [None, *(Hop(r.related_model, r.field) for r in histories)]:
            for rel in project_relations(job if hop is None else hop.model, db):
                if keeps(rel, db):
                    keeping.append((hop, rel))
                elif to_follow(rel):
                    followed.append((hop, rel))
        for sub, link in subclasses(job, job._meta.pk, db):
            for rel in project_relations(sub, db, own=job._meta.app_label):
                if keeps(rel, db):
                    keeping.append((Hop(sub, link), rel))
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
        self, db: str, state: str, days: float, after: Any, batch_size: int, refused: set[Any]
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
        pointed = "".join(
            f"\n              AND NOT EXISTS ({sql})" for sql in self._pointing_sql(db)
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
              {"AND j.id <> ALL(%(refused)s)" if refused else ""}
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
        params = {
            "state": state,
            "secs": days * 86400,
            "after": after,
            "limit": batch_size,
            "refused": sorted(refused),
        }
        check = connections[db].in_atomic_block
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            cursor.execute(sql, params)
            n, last = cursor.fetchone()
            if check:  # inside a caller's transaction: not at its commit
                check_foreign_keys_now(db, set())
        return n, last
