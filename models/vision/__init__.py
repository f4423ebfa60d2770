"""Image input for the vision-language checkpoints (Qwen3.5 / Qwen3.6): the vision tower, the
preprocessing of an image into its patches, and the text model's 3-D (M-RoPE) positions."""
