"""Hugging Face checkpoints: config checks, the tensor-name/layout table, MXFP4 decoding, safetensors I/O."""
