"""The gpuckpt agent: a daemon beside one serving worker (``gpuckpt agent run``)."""
