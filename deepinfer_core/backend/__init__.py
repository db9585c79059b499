"""The backend contract, discovery and selection: everything a backend author imports is here."""

from deepinfer_core.backend._steps import CostModel, GraphCapture, LinearCostModel
from deepinfer_core.backend.extensions import LogitsProcessor, ModelRegistry, Observer, RequestEvent, StepStats
from deepinfer_core.backend.hookspecs import API_VERSION, REQUIRED_BACKEND_HOOKS, BackendSpec, PluginSpec, hookimpl
from deepinfer_core.backend.ops import (
    BLOCK_FORMATS,
    OP_NAMES,
    V4_OPS,
    V41_OPS,
    AttentionMetadata,
    AttentionOps,
    BlockFP8,
    Ops,
    RoutingConfig,
    V4AttentionOps,
    V4Ops,
    V41AttentionOps,
    V41Ops,
    block_length,
)
from deepinfer_core.backend.types import BackendInfo, Capabilities, DeviceFacts, ProbeResult

__all__ = [
    "API_VERSION",
    "BLOCK_FORMATS",
    "block_length",
    "OP_NAMES",
    "V4_OPS",
    "V41_OPS",
    "REQUIRED_BACKEND_HOOKS",
    "AttentionMetadata",
    "AttentionOps",
    "BackendInfo",
    "BackendSpec",
    "BlockFP8",
    "Capabilities",
    "CostModel",
    "DeviceFacts",
    "GraphCapture",
    "LinearCostModel",
    "LogitsProcessor",
    "ModelRegistry",
    "Observer",
    "Ops",
    "PluginSpec",
    "ProbeResult",
    "RequestEvent",
    "RoutingConfig",
    "StepStats",
    "V4AttentionOps",
    "V4Ops",
    "V41AttentionOps",
    "V41Ops",
    "hookimpl",
]
