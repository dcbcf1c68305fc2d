"""The KV cache: pages, page tables, the image-aware prefix cache, the host tier and KV sizing."""
