"""Model toolchain: convert PyTorch / Hugging Face / ONNX models into served, versioned ONNX variants."""
