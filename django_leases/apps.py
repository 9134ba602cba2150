from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoLeasesConfig(AppConfig):
    name = "django_leases"
    label = "django_leases"
    verbose_name = _("Leased jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # django.tasks registers the check that runs each backend's check(); importing it
        # here makes sure our backend's checks run even before any @task module is loaded.
        import django.tasks  # noqa: F401
        from django.core.signals import setting_changed

        from . import checks  # noqa: F401 -- registers the database check
        from .conf import clear_options_cache

        setting_changed.connect(clear_options_cache, dispatch_uid="django_leases_options")
