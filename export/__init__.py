"""Workstation side (``edgemtp.export``): Hugging Face model -> edgemtp package.

The ONNX package exporter lands with the export issue; the PyTorch tree decoder it will trace
is ``edgemtp.models.decoder.TreeDecoder``.
"""
