"""What points at a job from a project's models, as prune must treat it.

A relation to a job (or to its failures and effects, which go with it, or to a project's
subclass of Job) either keeps the job (PROTECT, RESTRICT, DO_NOTHING under a constraint
Django made), is one Django's collector follows (CASCADE, SET_NULL, ...), or is the
database's own to follow (DB_CASCADE, ...). Read from the models' metadata and the
routers, never from the rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from django.db import models, router
from django.db.models import Q

# Django 6.1's database-level on_delete (DB_CASCADE, ...): the database follows them.
DATABASE_ON_DELETE: Any = getattr(models.deletion, "DatabaseOnDelete", ())
KEEPING = (models.PROTECT, models.RESTRICT)


def project_relations(model: Any, db: str, own: str | None = None) -> list[Any]:
    """Foreign keys and one-to-one fields pointing at ``model`` (hidden ones and
    many-to-many tables included) from models of apps other than ``own`` (by default,
    ``model``'s) that the routers place on ``db``; not a ForeignObject, which has no
    column of its own."""
    own = own or model._meta.app_label
    return [
        rel
        # Not those to a parent (a subclass of Job would repeat the job's).
        for rel in model._meta.get_fields(include_parents=False, include_hidden=True)
        if isinstance(rel, models.ForeignObjectRel)
        and (rel.one_to_many or rel.one_to_one)
        and rel.related_model._meta.app_label != own
        and isinstance(rel.field, models.ForeignKey)
        and router.allow_migrate_model(db, rel.related_model)
    ]


def subclasses(model: Any, key: Any, db: str) -> list[tuple[Any, Any]]:
    """A project's subclasses of ``model`` by multi-table inheritance, and theirs, that the
    routers place on ``db``, each with its field holding the job's id: its link to the
    parent, where that link holds the parent's ``key`` (the job's id). A subclass below
    one with a primary key of its own links to that key, not to the job's id: it is left
    to the collector (such a job is counted by prunable(), and kept by prune())."""
    found = []
    for rel in model._meta.get_fields(include_parents=False, include_hidden=True):
        if (
            isinstance(rel, models.OneToOneRel)
            and rel.parent_link
            and rel.field.target_field == key
            and router.allow_migrate_model(db, rel.related_model)
        ):
            found += [(rel.related_model, rel.field)]
            found += subclasses(rel.related_model, rel.field, db)
    return found


def keeps(rel: Any, db: str) -> bool:
    """Whether ``rel`` keeps the row it points at: PROTECT, RESTRICT, or DO_NOTHING under
    a foreign key constraint Django made (not from an unmanaged model such as a view)."""
    return rel.on_delete in KEEPING or (
        rel.on_delete is models.DO_NOTHING
        and rel.field.db_constraint
        and made_here(db, rel.related_model)
    )


def made_here(db: str, model: Any) -> bool:
    """Whether Django made ``model``'s table, with its constraints, on ``db``: managed,
    not a proxy, and placed there by the routers (a view's unmanaged model is not)."""
    return bool(model._meta.can_migrate(db) and router.allow_migrate_model(db, model))


def to_follow(rel: Any) -> bool:
    """Whether Django's collector has something to do for ``rel`` that the database does
    not do itself: CASCADE, SET_NULL, SET_DEFAULT, SET(...)."""
    return (
        rel.on_delete not in KEEPING
        and rel.on_delete is not models.DO_NOTHING
        and not isinstance(rel.on_delete, DATABASE_ON_DELETE)
    )


class Hop(NamedTuple):
    """A table between a job and a project's row pointing at it: one of this app's
    histories (failures, effects) or a project's subclass of Job; ``key`` is its field
    holding the job's id."""

    model: Any
    key: Any


def pointed_at(db: str, references: list[tuple[Any, Any]]) -> Q:
    """The jobs the rows of ``references`` point at, as a condition (empty: none); a
    reference is (None, a relation to the job) or (a Hop, a relation to the hop's
    model)."""
    condition = Q()
    for hop, rel in references:
        name = rel.field.name
        rows = rel.related_model._base_manager.using(db).filter(**{f"{name}__isnull": False})
        pointed = Q(**{f"{rel.field_name}__in": rows.values(name)})
        if hop is not None:
            between = hop.model._base_manager.using(db).filter(pointed)
            pointed = Q(pk__in=between.values(hop.key.name))
        condition |= pointed
    return condition
