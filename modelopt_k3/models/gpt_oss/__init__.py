"""GPT-OSS (``model_type: gpt_oss``): transformers' own ``GptOss*`` classes, MXFP4 routed experts.

``layout``: the checkpoint's OpenAI MXFP4 layout, transformers' ``GptOssExperts`` parameters and ModelOpt's
NVFP4 export layout, as pure functions.
"""
