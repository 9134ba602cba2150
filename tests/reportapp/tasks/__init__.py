"""A tasks package whose ``__init__`` imports none of its modules: discovery imports each."""
