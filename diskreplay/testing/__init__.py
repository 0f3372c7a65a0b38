"""Test support shipped with the package: a store-vs-model state machine and deterministic workloads.

Backends and store modes (single writer, many writers, later object storage)
run the same checks (``diskreplay.testing.stateful``), as zarr-python ships
``zarr.testing`` for its stores.
"""
