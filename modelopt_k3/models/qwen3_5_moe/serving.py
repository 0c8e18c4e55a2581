"""Placeholder replaced below."""
SERVING: dict = {}
