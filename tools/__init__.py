"""Workstation tools (``edgemtp.tools``): ``edgemtp bench``, ``edgemtp profile`` and
``edgemtp demo``.

They draw plots (matplotlib) and run ``transformers`` as an outside reference, so they live
outside the numpy core: ``import edgemtp`` never imports this package.
"""
