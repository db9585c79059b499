"""The reference backend `cpu`: plain PyTorch on CPU, the executable spec of the op contract."""
