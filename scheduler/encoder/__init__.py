"""The vision encoder: what to encode (manager), where it runs (executors), the embedding cache, pixels."""
