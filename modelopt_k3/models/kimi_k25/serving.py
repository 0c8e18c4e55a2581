"""placeholder"""
SERVING = {}
