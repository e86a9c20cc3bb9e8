"""Sessions under the provider policy: placement audit, ORT log capture, pinned host memory, library closure."""
