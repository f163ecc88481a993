"""Checkpoint cuts, pure: batching prefix chunks, cut receipts, restored-prefix checks."""
