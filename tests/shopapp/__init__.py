"""An app whose tasks module re-exports a task declared in another module (issue 15.3)."""
