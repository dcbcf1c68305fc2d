"""Helpers more than one role needs that are neither wire types nor transport
(`docs/design.md`, "Packages and seams"): `architectures` (the architecture table, which
imports nothing of Iris, so that `tiny_checkpoint` may read it too), `content_parts`,
`grammars`, `process_heap`. It imports `ipc` only, never a role.
"""
