"""Where an export writes: the output folder is checked before anything is loaded, the
package is written into a hidden partial folder beside it and renamed into place only when
whole, so a failed, interrupted or killed export never leaves a folder that looks complete.

::

    parent/
      stories/                    the package (appears only when whole)
      .stories.partial-4242/      export 4242 writing; removed if it fails
      .stories.old-4242/          the package --force replaces, moved aside during the swap

A process killed with SIGKILL cannot clean up after itself, so every export first tidies its
parent folder: a partial folder whose export is no longer running is removed, and an old
package left aside mid-swap is put back where it was if nothing replaced it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.runtimes.package import MANIFEST

# a partial folder older than this is stale even if its PID runs (a reused PID, or an export
# on another machine sharing the folder); a live export touches its folder at every stage
STALE_AFTER_S = 24 * 3600
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)$")


class ExportError(EdgeMTPError):
    """An export that cannot be done, or whose graph failed its own check."""


def check_destination(model: str, out, force: bool) -> Path:
    """The absolute output path, after the checks that need no writing. It must name a folder
    that does not hold the model being exported; an existing one is replaced only with
    ``force``, and only if it is a package (or empty)."""
    target = Path(os.path.abspath(out))
    if not str(out).strip() or not target.name:
        raise ExportError(f"the output must name a package folder, got {str(out)!r}")
    for path in (str(out), str(target)):  # (torch's ONNX writer takes UTF-8 paths only)
        try:
            path.encode("utf-8")
        except UnicodeEncodeError as e:  # (bytes that were not UTF-8)
            raise ExportError(f"the output path {path!r} is not valid UTF-8 (an undecodable "
                              f"byte at character {e.start}); choose a UTF-8 folder name"
                              ) from None
    if not target.exists():
        return target
    if not target.is_dir():
        raise ExportError(f"the output {str(out)!r} is a file, not a folder; remove it or "
                          f"choose another output folder")
    src = Path(model)
    if src.exists() and (src.resolve() == target.resolve()
                         or target.resolve() in src.resolve().parents):
        raise ExportError(f"the output folder {str(out)!r} holds the model being exported; "
                          f"choose another output folder")
    if not force:
        raise ExportError(f"the output folder {str(out)!r} exists; pass --force to replace it")
    if not (target / MANIFEST).is_file() and any(target.iterdir()):
        raise ExportError(f"the output folder {str(out)!r} is not an edgemtp package (no "
                          f"{MANIFEST}) and not empty; --force replaces only a package, so "
                          f"choose another output folder")
    return target


@contextmanager
def partial_folder(out: Path):
    """Create ``.NAME.partial-PID`` beside ``out`` (and the folders above it), yield it, and
    remove it (and the folders this created) if the body fails or is interrupted."""
    created: list[Path] = []
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        _make_parents(out, created)
        tidy(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # this PID's own, from a run long gone
        _mkdir(tmp, out)
        yield tmp
    except BaseException:  # interrupts included: never leave a half-written package
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:  # not empty: something else writes there too
                break
        raise


def touch(tmp: Path) -> None:
    """Mark a partial folder as belonging to a live export (see :data:`STALE_AFTER_S`)."""
    os.utime(tmp)


def swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished package into place; an old one (``--force``) is moved aside only
    now, and put back if the rename fails."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    if old.is_symlink():  # a link named as the output: the link is replaced, its target kept
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def tidy(parent: Path) -> None:
    """Remove what killed exports left in ``parent``; never a live export's folder."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return  # unreadable: the export's own mkdir will report the folder
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if not m or entry.is_symlink() or not entry.is_dir() or not _stale(entry, int(m["pid"])):
            continue
        home = parent / m["name"]
        if m["kind"] == "old" and not home.exists():
            entry.rename(home)  # killed mid-swap: the replaced package goes back in place
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _stale(folder: Path, pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        age = time.time() - folder.stat().st_mtime
    except OSError:
        return False
    return age > STALE_AFTER_S or not _running(pid)


def _running(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it: only the age rule applies
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):  # not a PID this system can have
        return False
    except OSError:  # EPERM: running, as another user
        return True
    return True


def _make_parents(out: Path, created: list[Path]) -> None:
    """Create the folders above ``out`` that are missing, appending each to ``created``."""
    missing = []
    for folder in out.parents:
        if folder.exists():
            if not folder.is_dir():
                raise ExportError(f"cannot write the package to {str(out)!r}: "
                                  f"{str(folder)!r} is a file, not a folder")
            break
        missing.append(folder)
    for folder in reversed(missing):
        _mkdir(folder, out)
        created.append(folder)


def _mkdir(folder: Path, out: Path) -> None:
    try:
        folder.mkdir()
    except OSError as e:
        raise ExportError(f"cannot write the package to {str(out)!r}: creating "
                          f"{str(folder)!r} failed ({e.strerror or type(e).__name__}); choose "
                          f"a writable output folder") from None
