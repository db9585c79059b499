"""DeepInfer backend for NVIDIA GPUs. Importing this package imports neither CUDA APIs nor triton."""
