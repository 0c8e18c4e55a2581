"""What every model on transformers' own MoE classes shares (not a model type: ``spec.registry`` skips it).

``experts``: transformers' experts instances re-classed onto our experts base, with transformers' eager
expert-order combine; ``kv_cache``: the MLA KV-cache site (DeepSeek-V3 on transformers' classes, Kimi-K3 on
its remote code); ``spec``: ``transformers_moe_spec``, the spec builder that derives the experts classes, the
checkpoint conversion and the layer regexes from transformers. A model package keeps what truly differs:
recipes, serving rules, source formats, memory and probe quirks (docs/decisions/0004-transformers-native-spec.md).
No model package imports another (``tests/models/test_model_isolation.py``); they import this one.
"""
