"""Schedule: Graph -> Kernels (the loop-level IR, fusion decisions and the buffer plan).

Input: a verified, optimized Graph whose shapes are concrete. Output: a :class:`Program`, the
ordered steps a backend's code generator prints: fused loop kernels (pointwise or reductions
over rows), extern calls executed by PyTorch, and views of buffers, with the buffers each step
reads and writes and when each buffer dies. Nothing here knows Triton or C++.
"""
