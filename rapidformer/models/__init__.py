"""Model builders: Hugging Face models from a hub name, a directory or a config."""
