"""Types of the C extension `_flatscan.c` (read through `kvtune.ingest.flatscan`)."""

from _typeshed import ReadableBuffer

def scan_block(
    block: ReadableBuffer, keys: tuple[bytes, ...], kinds: bytes, /
) -> (
    tuple[
        int,  # rows: records (non-blank lines)
        int,  # lines in the block, a last one without "\n" included
        bytearray | None,  # int64 line index of each record; None: record i is line i
        list[bytearray | None],  # per key: values (int64, float64, int32 codes or bool); None: in no record
        list[bytearray | None],  # per key: valid flags (bool); None: all valid, or in no record
        list[list[str] | None],  # per key: LABEL texts in first-seen order; None for other kinds
    ]
    | None
):
    """The typed columns of `keys` over the whole lines of `block`, or None if any record is not clean."""
