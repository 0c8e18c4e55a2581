"""Memory planning: per-rank memory of a PTQ run from config.json and the safetensors headers alone."""
