"""Helpers more than one role needs that are neither wire types nor transport
(`docs/design.md`, "Packages and seams"): `content_parts`, `grammars`, `process_heap`.
It imports `ipc` only, never a role.
"""
