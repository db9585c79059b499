"""The `ascend950` backend's hooks.

May import: torch and deepinfer_core at module import. torch_npu is imported only inside the probe,
after the cheap checks (package present, CANN present, device nodes present) have passed, and by the
kernels once this backend is selected: without CANN, importing torch_npu fails and breaks torch.
Kernels (ops, KV layout, attention) are not implemented yet, so the registry reports this backend as
unavailable for that reason even on an NPU machine. It has never run on Ascend hardware.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from deepinfer_core.backend import API_VERSION, OP_NAMES, BackendInfo, Capabilities, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind

DEEPINFER_API_VERSION = API_VERSION
_NOT_YET = "torch_npu ops are not wired in yet in this release of deepinfer-ascend950"


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name="ascend950",
        description="Huawei Ascend NPUs (Ascend 950): torch_npu / CANN ops, HCCL",
        device_kind="npu",
        priority=100,
        aliases=("ascend",),
    )


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("bfloat16", "float16"),
        cache_kinds=(CacheKind.PAGED,),
        block_sizes=(128,),  # Ascend's paged-attention kernels require 128-token blocks
        communicators=("in_process",),
        unsupported=tuple((op, _NOT_YET) for op in OP_NAMES),
    )


def _cann_home() -> str | None:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(var):
            return os.environ[var]
    default = "/usr/local/Ascend/ascend-toolkit/latest"
    return default if os.path.isdir(default) else None


@hookimpl
def deepinfer_backend_probe():
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult.unavailable(
            "torch_npu is not installed (on a machine with CANN: pip install 'deepinfer-ascend950[npu]')"
        )
    cann = _cann_home()
    if cann is None:
        return ProbeResult.unavailable(
            "CANN toolkit not found: ASCEND_HOME_PATH is unset and /usr/local/Ascend is missing "
            "(source <CANN>/set_env.sh)"
        )
    if not glob.glob("/dev/davinci[0-9]*"):
        return ProbeResult.unavailable("no NPU visible: no /dev/davinci* device nodes", cann=cann)
    try:
        importlib.import_module("torch_npu")
        import torch

        count = torch.npu.device_count()
        name = torch.npu.get_device_name(0) if count else ""
    except Exception as err:  # a broken CANN install must be a reason, not a crash
        return ProbeResult.unavailable(f"torch_npu failed to initialise: {type(err).__name__}: {err}", cann=cann)
    if count == 0:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "unset")
        return ProbeResult.unavailable(f"no NPU visible (ASCEND_RT_VISIBLE_DEVICES={visible})", cann=cann)
    return ProbeResult.ok(f"{name}, {count} NPU(s), CANN at {cann}", npu=name, npus=str(count), cann=cann)
