"""The app's tasks module: discovery imports it, and with it the tasks it imports."""

from __future__ import annotations

from .jobs import packed

__all__ = ["packed"]
