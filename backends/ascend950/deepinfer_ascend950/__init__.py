"""DeepInfer backend for Ascend NPUs. Importing this package never imports torch_npu."""
