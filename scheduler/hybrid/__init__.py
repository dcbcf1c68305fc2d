"""A hybrid model's linear-attention state: the slot pool and the slots' owner."""
