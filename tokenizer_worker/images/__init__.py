"""A request's images in the worker: keys, uuids, the processor cache, resizing as the HF processor does, client embeddings, and the arena pins a request holds."""
