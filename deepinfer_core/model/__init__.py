"""Model code written against the backend contract, the checkpoint loader, and the model registry."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import pluggy

from deepinfer_core.backend.extensions import ModelRegistry
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.config_v4 import DeepseekV4Config
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, QUANTIZED_WEIGHTS, DeepseekV3Model, expected_weights
from deepinfer_core.model.deepseek_v4 import (
    FLOAT32_WEIGHTS_V4,
    QUANTIZED_WEIGHTS_V4,
    DeepseekV4Model,
    expected_weights_v4,
)
from deepinfer_core.model.deepseek_v41 import (
    FLOAT32_WEIGHTS_V41,
    DeepseekV41Model,
    engram_tables_kept,
    expected_weights_v41,
    token_map_for,
)
from deepinfer_core.model.dspark import load_dspark
from deepinfer_core.model.loader import CheckpointError, kept_formats, load_tensors, read_config
from deepinfer_core.model.mtp import MTPDrafter, mtp_weight_shapes
from deepinfer_core.model.mtp_v4 import MTPDrafterV4, mtp_layer_config, mtp_v4_spellings, mtp_v4_weight_shapes
from deepinfer_core.model.v4_names import v4_spellings
from deepinfer_core.model.v41_names import v41_spellings

__all__ = [
    "load_deepseek",
    "load_deepseek_v4",
    "load_deepseek_v41",
    "load_drafter",
    "load_model",
    "model_registry",
]


def load_deepseek(path: Path, raw_config: dict[str, Any], backend: ResolvedBackend, progress: bool = True):
    config = DeepseekConfig.from_hf(raw_config)
    keep = kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS)
    weights = load_tensors(path, raw_config, expected_weights(config), backend.dtype, FLOAT32_WEIGHTS, progress, keep)
    return DeepseekV3Model(config, weights, backend)


def load_deepseek_v4(path: Path, raw_config: dict[str, Any], backend: ResolvedBackend, progress: bool = True):
    config = DeepseekV4Config.from_hf(raw_config)
    weights = load_tensors(
        path,
        raw_config,
        expected_weights_v4(config),
        backend.dtype,
        FLOAT32_WEIGHTS_V4,
        progress,
        kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS_V4),
        spellings=v4_spellings,  # ours (transformers' first V4 names) or DeepSeek-native
    )
    return DeepseekV4Model(config, weights, backend)


def load_deepseek_v41(
    path: Path,
    raw_config: dict[str, Any],
    backend: ResolvedBackend,
    progress: bool = True,
    engram_placement: str = "auto",
):
    config = DeepseekV41Config.from_hf(raw_config)
    token_map = token_map_for(config, path)  # before loading: a wrong tokenizer fails at once
    weights = load_tensors(
        path,
        raw_config,
        expected_weights_v41(config),
        backend.dtype,
        FLOAT32_WEIGHTS_V41,
        progress,
        engram_tables_kept(kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS_V4)),
        spellings=v41_spellings(config),  # ours, DeepSeek-native or newer-transformers names
    )
    return DeepseekV41Model(config, weights, backend, token_map, engram_placement)


def model_registry(plugin_manager: pluggy.PluginManager | None = None, engram_placement: str = "auto") -> ModelRegistry:
    """Built-in architectures plus those registered by `deepinfer.plugins` plugins. engram_placement (one of
    v41_engram.ENGRAM_PLACEMENTS) is bound into the DeepSeek-V4.1 factory, the one model with Engram tables."""
    registry = ModelRegistry()
    for architecture in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        registry.register(architecture, load_deepseek)
    registry.register("DeepseekV4ForCausalLM", load_deepseek_v4)
    registry.register("DeepseekV41ForCausalLM", partial(load_deepseek_v41, engram_placement=engram_placement))
    if plugin_manager is not None:
        plugin_manager.hook.deepinfer_register_models(registry=registry)
    return registry


def load_model(path: Path, backend: ResolvedBackend, registry: ModelRegistry, progress: bool = True):
    """Read config.json, pick the factory for its architecture and build the model on `backend`."""
    raw = read_config(path)
    architectures = raw.get("architectures") or []
    for architecture in architectures:
        if architecture in registry.architectures():
            return registry.get(architecture)(path, raw, backend, progress)
    known = ", ".join(registry.architectures())
    raise CheckpointError(
        f"unknown architecture {', '.join(architectures) or '(none)'} in {path}/config.json; DeepInfer serves {known}"
    )


def load_drafter(method: str, path: Path | None, model, backend: ResolvedBackend, progress: bool = True):
    """The draft model a speculative `method` needs, from the checkpoint at `path` (None: ngram needs none).
    dspark: a DeepSeek-V4.1 checkpoint's DSpark layers (model/dspark.py).
    mtp: the MTP layer of a DeepSeek-V3 / V2-style checkpoint (model/mtp.py) or of a DeepSeek-V4 one
    (model/mtp_v4.py)."""
    if method == "ngram":
        return None
    if method == "dspark":
        if not isinstance(model, DeepseekV41Model) or path is None:
            raise CheckpointError(
                f"speculative method 'dspark' drafts with a DeepSeek-V4.1 checkpoint's DSpark layers; "
                f"{type(model).__name__} {'(the embedded demo model) ' if path is None else ''}has none: "
                'use {"method": "mtp"} (V3, V4) or {"method": "ngram"}'
            )
        return load_dspark(path, read_config(path), model, backend, progress)
    if not isinstance(model, (DeepseekV3Model, DeepseekV4Model)) or path is None:
        raise CheckpointError(
            f"speculative method {method!r} drafts with a DeepSeek-V3 or V4 checkpoint's MTP layer; "
            f"{type(model).__name__} {'(the embedded demo model) ' if path is None else ''}has none here: "
            'use {"method": "ngram"}'
        )
    raw = read_config(path)
    config = model.config
    layers = int(raw.get("num_nextn_predict_layers") or 0)
    if layers < 1:
        raise CheckpointError(
            f"{path}/config.json has num_nextn_predict_layers = {layers}: the checkpoint has no MTP layer to "
            'draft with; use {"method": "ngram"}'
        )
    if isinstance(model, DeepseekV4Model):
        return _load_mtp_v4(path, raw, model, backend, progress)
    prefix = f"model.layers.{config.num_hidden_layers}."  # a decoder layer's tensors, as layer num_hidden_layers
    deeper = dataclasses.replace(config, num_hidden_layers=config.num_hidden_layers + 1)
    block = {name: shape for name, shape in expected_weights(deeper).items() if name.startswith(prefix)}
    keep = kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS)
    weights = load_tensors(path, raw, mtp_weight_shapes(config, block), backend.dtype, FLOAT32_WEIGHTS, progress, keep)
    return MTPDrafter(model, weights, backend)


def _load_mtp_v4(path: Path, raw: dict[str, Any], model: DeepseekV4Model, backend: ResolvedBackend, progress: bool):
    layer_config = mtp_layer_config(model.config, raw)
    shapes = mtp_v4_weight_shapes(model.config, layer_config)
    try:
        weights = load_tensors(
            path,
            raw,
            shapes,
            backend.dtype,
            FLOAT32_WEIGHTS_V4,
            progress,
            kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS_V4),
            spellings=mtp_v4_spellings,
        )
    except CheckpointError as err:
        raise CheckpointError(
            f"the MTP layer (mtp.0.*) that config.json's num_nextn_predict_layers promises: {err}. (transformers "
            "drops DeepSeek-V4's mtp.* tensors on load, so a checkpoint it saved has none: use the checkpoint as "
            'DeepSeek released it, or {"method": "ngram"})'
        ) from None
    return MTPDrafterV4(model, layer_config, weights, backend)
