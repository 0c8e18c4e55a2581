"""Tests of modelopt_k3.models.qwen3_moe."""
