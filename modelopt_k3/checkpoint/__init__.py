"""Reading a source checkpoint: the one safetensors reader (``reader``), its headers checked against
config.json (``source_check``), and the policy for values that are not numbers (``nonfinite``)."""

from .reader import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    CheckpointError,
    CheckpointReader,
    ReadLog,
    TensorInfo,
    read_config,
    read_header,
    read_json,
    read_shard,
)

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "CheckpointError",
    "CheckpointReader",
    "ReadLog",
    "TensorInfo",
    "read_config",
    "read_header",
    "read_json",
    "read_shard",
]
