"""Per-family model knowledge (``edgemtp.models``): the family registry and the PyTorch tree
decoder shared by the reference backend and the exporter."""

from .families import FAMILIES, Family, family_for

__all__ = ["FAMILIES", "Family", "family_for"]
