"""The data types that cross the engine protocol (engines/protocol.py), one module per concern: request (batches,
images, edits, LoRA uses, step caches, results), model (the served model's limits, working memory, adapter library),
health (canaries, faults, telemetry, signature) and snapshot (ORT events, the self-test report, capabilities)."""
