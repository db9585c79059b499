"""DeepInfer core: backend-agnostic policy for serving DeepSeek MoE models; never imports a vendor library."""

__version__ = "0.1.0"
