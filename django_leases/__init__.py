"""A Django job queue in the project's own database, built on leases and heartbeats."""

__version__ = "0.1.0"
