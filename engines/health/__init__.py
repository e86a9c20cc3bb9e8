"""Proving the fast path: preflight against the version matrix, NVML telemetry, the GPU signature, the boot
self-test and its canaries."""
