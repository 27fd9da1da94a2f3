"""The KV and its format: what lmtier stores, how it is named, and how it travels.

layout  KVLayout: the shape of one model's KV, bytes per token, the canonical shapes
keys    Namespace and the chained chunk keys (content addresses)
chunk   Chunk: one chunk's KV as a view over a buffer, with its key, layout, checksum
codec   the frame of bytes that leave the process (disk, network): header, payload, checksum
sizing  what a model's KV costs, and what fits where (``lmtier size``)
"""
