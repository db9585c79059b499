"""Does not declare which contract version it was built for."""

from deepinfer_test_broken._base import deepinfer_backend_capabilities, deepinfer_backend_probe, info_hook  # noqa: F401

deepinfer_backend_info = info_hook("no_version")
