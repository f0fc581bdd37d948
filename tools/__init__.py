"""Workstation tools (``edgemtp.tools``): ``edgemtp bench``, ``edgemtp profile`` and
``edgemtp demo``.

They draw plots (matplotlib) and run ``transformers`` as an outside reference, so they live
outside the numpy core: ``import edgemtp`` never imports this package, and every heavy
dependency here is imported inside the function that needs it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from edgemtp.errors import BudgetError, ConfigError


@contextlib.contextmanager
def output_folder(path: str):
    """The ``--out`` folder, made now (before minutes of measuring), or one line saying why
    it cannot be. A ``with`` block: where the work inside it fails (a budget the model
    refuses once it is loaded, Ctrl-C before a row is kept), the folders it made are removed
    again while they are still empty, so a refused run leaves nothing behind.

    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile(delete=False); f.close()
    >>> with output_folder(f.name): pass
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: --out ... is a file; expected a folder to write the results in
    >>> os.unlink(f.name)
    >>> d = Path(tempfile.mkdtemp())
    >>> try:
    ...     with output_folder(str(d / "a" / "b")) as out:
    ...         assert out.is_dir(); raise ConfigError("refused")
    ... except ConfigError:
    ...     pass
    >>> sorted(os.listdir(d))
    []
    """
    import os

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; expected a folder to write the "
                          f"results in")
    made = [p for p in (out, *out.absolute().parents) if not p.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot make the folder ({e.strerror or e}); "
                          f"give a folder you can write to") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r} is not writable; give a folder you can write to")
    try:
        yield out
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()  # only while empty
            except OSError:
                break
        raise


def at_least_one(**counts: int) -> None:
    """Check command-line counts (``--prompts``, ``--repeats``, ...) before any work starts.

    >>> at_least_one(repeats=2)
    >>> at_least_one(repeats=0)
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: --repeats must be an integer >= 1, got 0
    """
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")


def check_fits(budgets, max_context: int, what: str = "--bc") -> None:
    """Every budget's block must fit the model's KV cache next to one committed token.

    >>> check_fits([10, 600], 512)
    Traceback (most recent call last):
    ...
    edgemtp.errors.BudgetError: --bc 600 does not fit the model's context of 512 tokens; ...
    """
    for bc in budgets:
        if bc >= max_context:
            raise BudgetError(f"{what} {bc} does not fit the model's context of {max_context} "
                              f"tokens; use a budget below {max_context}")


def quiet_transformers(path: str | None = None) -> None:
    """Hide ``transformers``' own "Loading weights" bar before loading the model at ``path``
    (the tools show their own progress). Imports nothing when ``path`` is an exported package,
    which loads without ``transformers``, or when ``transformers`` is not installed."""
    if path is not None and (Path(path) / "edgemtp.json").is_file():
        return
    try:
        from transformers.utils import logging
    except ModuleNotFoundError:
        return
    logging.disable_progress_bar()
