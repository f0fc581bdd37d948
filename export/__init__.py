"""Workstation side (``edgemtp.export``): Hugging Face model -> edgemtp package.

``edgemtp.export.onnx_export.export_package`` traces the PyTorch tree decoder
(``edgemtp.models.decoder.TreeDecoder``) to ``model.onnx``, checks it against PyTorch and
writes the package that ``edgemtp.runtimes.package`` describes and validates.
"""
