"""``edgemtp serve``: an OpenAI-compatible local server over one loaded :class:`~edgemtp.Model`.

Layout, one concept per module:

- :mod:`.requests`: the request bodies (pydantic), their checks and the OpenAI error shape;
- :mod:`.scheduler`: admission (``--parallel`` running, a bounded queue, 429 beyond it) and
  the worker threads that run generations step by step, cancellable between steps;
- :mod:`.app`: the FastAPI routes, server-sent events and the safety limits;
- :mod:`.metrics`: the Prometheus counters and histograms of ``GET /metrics``.

Only ``edgemtp serve`` imports this package's dependencies (FastAPI, uvicorn, pydantic,
prometheus_client: ``pip install 'edgemtp[serve]'``); the core never does.
"""

from __future__ import annotations

import importlib.util

from ..errors import BackendUnavailableError

REQUIRES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def check_dependencies() -> None:
    """One line naming the first missing package, before the model is loaded."""
    for name in REQUIRES:
        if importlib.util.find_spec(name) is None:
            raise BackendUnavailableError(
                f"edgemtp serve needs the Python package {name!r}, which is not installed "
                f"(pip install 'edgemtp[serve]')")
