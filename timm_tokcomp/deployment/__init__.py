"""What leaves the measuring for use: the --methods grammar (specs), the preset file (presets), the execution modes
and their one runner (modes), the one-call deployment of a preset (deploy) and ONNX export (onnx)."""
