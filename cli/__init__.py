"""The ``gpuckpt`` command line: the app in :mod:`cli.app`, one verb group per ``*_cmds.py``,
the console script in :mod:`cli.main`."""
