from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoLeasesConfig(AppConfig):
    name = "django_leases"
    label = "django_leases"
    verbose_name = _("Leased jobs")
    default_auto_field = "django.db.models.BigAutoField"
