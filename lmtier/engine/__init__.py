"""The engine side: KV between an engine's paged cache and canonical chunks, CPU and GPU.

    transfer    CopyEngine: gathers a chunk's blocks out of the paged cache, scatters them back
    layerload   LoadPlan, LayerLoad: a step's loads in groups of layers, each waited for by its layer
    devicecopy  IndexCopier: the same with index kernels on the cache's device (the CUDA path)

The only code that knows engine layouts. It moves bytes and decides nothing: the
adapters (``lmtier.connectors``) plan which blocks to load and save.
"""
