"""A checkpoint exported for runtimes outside PyTorch (ONNX, torch.export), verified against it."""
