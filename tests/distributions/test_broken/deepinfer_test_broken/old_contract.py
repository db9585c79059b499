"""Built for a contract major version this DeepInfer does not speak."""

from deepinfer_test_broken._base import deepinfer_backend_capabilities, deepinfer_backend_probe, info_hook  # noqa: F401

DEEPINFER_API_VERSION = 999
deepinfer_backend_info = info_hook("old_contract")
