"""LoRA per request: the adapter library, the variant sessions that take merged weights, the merged-set cache."""
