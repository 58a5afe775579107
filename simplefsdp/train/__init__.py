"""The trainer: config (TOML -> dataclasses), data, training loop, checkpoints, metrics."""
