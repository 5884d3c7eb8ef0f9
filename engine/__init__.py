"""The shared engine: config, registry, loop, checkpointing, logging."""
