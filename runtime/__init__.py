"""The front process: gRPC services, model table and worker supervision.

It never imports model code or decodes tensors; see ../README.md.
"""

__version__ = "0.1.0"
