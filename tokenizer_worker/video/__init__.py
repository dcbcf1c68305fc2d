"""A request's videos in the worker: decoding, the model's sampling rules, temporal patches, pruning."""
