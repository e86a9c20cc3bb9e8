"""The pipelines wing: one file per architecture (unet.py; flow.py's base with flux.py, sd3.py, qwen.py) behind
the architecture registry (engines/architectures.py); the contract at the bottom (contract.py)."""
