"""The seed's helpers for white-box scripts: `mpu`, `get_args()`, `get_tokenizer()`. They are
the only readers of the active run (the config the entrypoint activated in this process)."""
