"""The nvidia_sm100 KV layout: core's PackedKVLayout (row per slot; DeepSeek-V4.1's KV packed in its formats),
writing packed rows with one kernel (kernels.rounding.pack_rows: the bytes kv.formats.pack gives)."""

from __future__ import annotations

import torch

from deepinfer_core.kv.layout import CacheSpec
from deepinfer_core.kv.packed import PackedKVLayout
from deepinfer_nvidia_sm100.kernels import rounding

__all__ = ["NvidiaKVLayout"]


class NvidiaKVLayout(PackedKVLayout):
    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        if spec.stored_format:
            rounding.pack_rows(values, spec.stored_format, cache, slots)
        else:
            super().write(cache, spec, slots, values)
