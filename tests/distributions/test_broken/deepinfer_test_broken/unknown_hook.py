"""Implements a hook the contract does not have (a typo of deepinfer_backend_ops)."""

from deepinfer_core.backend import API_VERSION, hookimpl
from deepinfer_test_broken._base import deepinfer_backend_capabilities, deepinfer_backend_probe, info_hook  # noqa: F401

DEEPINFER_API_VERSION = API_VERSION
deepinfer_backend_info = info_hook("unknown_hook")


@hookimpl
def deepinfer_backend_opz(device, dtype):
    raise AssertionError("never called")
