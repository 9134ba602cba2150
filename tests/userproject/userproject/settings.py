"""Settings as a user writes them: the admin, django_leases, one app with tasks.

USER_DATABASE=sqlite (a file beside this project) or postgres (USER_PG_NAME on
USER_PG_HOST:USER_PG_PORT as USER_PG_USER).
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "a-user-project-in-a-test"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_leases",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "userproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if os.environ.get("USER_DATABASE", "sqlite") == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ["USER_PG_NAME"],
            "USER": os.environ.get("USER_PG_USER", "postgres"),
            "PASSWORD": os.environ.get("USER_PG_PASSWORD", ""),
            "HOST": os.environ.get("USER_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("USER_PG_PORT", "5432"),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "db.sqlite3",
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }

TASKS = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"LEASE_SECONDS": 30, "MAX_ATTEMPTS": 3},
    },
}
