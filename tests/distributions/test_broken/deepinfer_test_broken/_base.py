"""A valid minimal backend the broken ones start from (not an entry point itself)."""

from deepinfer_core.backend import BackendInfo, Capabilities, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind


def info_hook(name):
    @hookimpl
    def deepinfer_backend_info():
        return BackendInfo(name, "broken test backend", "cpu", priority=70)

    return deepinfer_backend_info


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(dtypes=("float32",), cache_kinds=(CacheKind.PAGED,))


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.ok("present")
