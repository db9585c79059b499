"""A hook whose argument name is not in the contract (devce instead of device)."""

from deepinfer_core.backend import API_VERSION, hookimpl
from deepinfer_test_broken._base import deepinfer_backend_capabilities, deepinfer_backend_probe, info_hook  # noqa: F401

DEEPINFER_API_VERSION = API_VERSION
deepinfer_backend_info = info_hook("bad_signature")


@hookimpl
def deepinfer_backend_ops(devce, dtype):
    raise AssertionError("never called")
