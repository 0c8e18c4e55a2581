"""Checkpoint writing: the ModelOpt HF format, streamed into shards, atomically."""
