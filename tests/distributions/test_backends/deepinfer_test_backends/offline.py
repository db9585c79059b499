"""A complete backend with the highest priority whose probe says its device is absent."""

from deepinfer_core.backend import API_VERSION, BackendInfo, Capabilities, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind
from deepinfer_test_backends import fakeaccel

DEEPINFER_API_VERSION = API_VERSION


@hookimpl
def deepinfer_backend_info():
    return BackendInfo("offline", "test accelerator that is never plugged in", "npu", priority=90)


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(dtypes=("float32",), cache_kinds=(CacheKind.PAGED,))


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.unavailable("no offline device visible: /dev/offline0 is missing")


deepinfer_backend_device = fakeaccel.deepinfer_backend_device
deepinfer_backend_ops = fakeaccel.deepinfer_backend_ops
deepinfer_backend_kv_layout = fakeaccel.deepinfer_backend_kv_layout
deepinfer_backend_attention = fakeaccel.deepinfer_backend_attention
