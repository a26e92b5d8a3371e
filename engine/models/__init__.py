"""Model definitions: one file per family, a registry keyed by config.json ``architectures``."""
