"""Triton kernels of the nvidia_sm100 backend, one module per family; imported only once the backend is
selected (never by the probe). Each launcher takes torch tensors and returns torch tensors."""
