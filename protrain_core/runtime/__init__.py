"""The runtime: chunk storage and lifecycle, the hooks that move chunks, the per-chunk
optimizer, activation management, and the ``Engine`` that ties them to one model."""
