"""A tiny byte-level tokenizer for the stand-in checkpoint (loads offline with AutoTokenizer).

Ids 0-255 are the 256 bytes (GPT-2 style byte-to-unicode alphabet, no merges), followed by the
special tokens. Any text round-trips exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BOS, EOS, PAD, MEDIA = "<|bos|>", "<|eos|>", "<|pad|>", "<|media_pad|>"


def byte_to_unicode() -> dict[int, str]:
    """Map each byte to a printable unicode character (the alphabet ByteLevel pre-tokenisation uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def make_byte_tokenizer(
    path: str | Path,
    *,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    media_token_id: int,
    vocab_size: int,
) -> None:
    """Save tokenizer.json / tokenizer_config.json / special_tokens_map.json into `path`."""
    from transformers import PreTrainedTokenizerFast

    specials = {bos_token_id: BOS, eos_token_id: EOS, pad_token_id: PAD, media_token_id: MEDIA}
    if sorted(specials) != list(range(256, 256 + len(specials))):
        raise ValueError(f"special token ids must be 256..{255 + len(specials)}, got {sorted(specials)}")
    if 256 + len(specials) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for the byte tokenizer (needs 260)")

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    for token_id, token in specials.items():
        vocab[token] = token_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[MEDIA],
        model_max_length=4096,
    )
    fast.save_pretrained(str(path))


def calibration_token_ids(num: int = 4, seq: int = 32, seed: int = 1234, vocab: int = 256) -> torch.Tensor:
    """``[num, seq]`` byte-token ids, seeded: the calibration and logits checks of the transformers-class
    stand-ins (and the tokens the Qwen3-MoE golden's ModelOpt run sees)."""
    return torch.randint(0, vocab, (num, seq), generator=torch.Generator().manual_seed(seed))
