"""Text-to-image diffusion: the pipeline, schedulers as per-step coefficients, the step graph, the tokenizer."""
