"""Helpers more than one role needs that are neither wire types nor transport, so they
belong in no one role and not in `ipc/`:

- `content_parts`: how an OpenAI image content part names its image (the server's image
  router and the tokenizer worker read parts the same way);
- `grammars`: a structured-output constraint as an llguidance grammar (the server
  validates it, the scheduler compiles it: one translation);
- `process_heap`: every process freezes its start-up heap before it serves.

It imports `ipc` only, never a role.
"""
