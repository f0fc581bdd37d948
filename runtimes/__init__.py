"""Backends behind one small interface (``edgemtp.runtimes``); see ``edgemtp.backend``.

Each backend module imports its heavy dependency itself, so importing this package is free.
"""
