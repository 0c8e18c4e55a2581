"""The export formats' names: the keys of the export-format registry (``export/layouts.py``, which refuses
a format missing from here or a name without a format). Pure (no torch), so the CLI builds
``--export_format``'s choices from them before importing torch."""

from __future__ import annotations

from ..dist.kinds import _StrEnum


class ExportFormatName(_StrEnum):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


EXPORT_FORMAT_NAMES: tuple[str, ...] = tuple(ExportFormatName)
