"""deepinfer-rowwise-cpu: an example vendor backend for DeepInfer, written from scratch against the contract."""

__version__ = "0.1.0"
