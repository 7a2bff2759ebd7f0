"""FSDP2 trainer for Ray Train; the contract module is importable without torch."""
