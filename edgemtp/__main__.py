"""``python -m edgemtp``: the ``edgemtp`` command (for an environment whose scripts folder is
not on PATH)."""
from edgemtp.cli import entry

entry()
