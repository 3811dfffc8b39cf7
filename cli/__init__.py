"""The ``gpuckpt`` command line (see :mod:`cli.main`)."""
