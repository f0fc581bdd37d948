"""Run the ``edgemtp`` command line from this source tree, uninstalled (a bare GPU machine
with PyTorch and no internet): ``python bench/edgemtp_tree.py doctor``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import _edgemtp_from_tree  # noqa: E402  (imports edgemtp from the tree)

if "edgemtp.cli" not in sys.modules:
    _edgemtp_from_tree()

from edgemtp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
