"""Data: local files and hub datasets for fine-tuning, synthetic pairs, tokenizers, samplers."""
