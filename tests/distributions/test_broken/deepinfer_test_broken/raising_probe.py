"""A probe that raises: listed as unavailable with the error, never crashes discovery."""

from deepinfer_core.backend import API_VERSION, hookimpl
from deepinfer_test_broken._base import deepinfer_backend_capabilities, info_hook  # noqa: F401

DEEPINFER_API_VERSION = API_VERSION
deepinfer_backend_info = info_hook("raising_probe")


@hookimpl
def deepinfer_backend_probe():
    raise OSError("driver handshake failed")
