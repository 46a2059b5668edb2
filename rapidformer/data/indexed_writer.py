"""Megatron's indexed dataset (.bin/.idx), written with NumPy alone.

The format is megatron-core's `IndexedDatasetBuilder`'s, byte for byte (tests/test_preprocess.py
compares the two): the .bin holds the tokens of every sequence one after another; the .idx
holds the magic `MMIDIDX\\x00\\x00`, version 1 (u64), the token dtype's code (u8), the sequence
and document counts (u64), each sequence's length (int32), its byte offset in the .bin (int64),
and the sequence index at which each document ends, after a leading 0 (int64).

Written by hand because importing megatron-core for its builder loads its whole model stack
(about 11 s on 2 cores, in every preprocessing run); reading stays megatron-core's
`IndexedDataset`.
"""
from __future__ import annotations

import struct

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron-core's DType codes
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
               np.float32: 7, np.uint16: 8}


def token_dtype(vocab_size: int | None) -> type:
    """megatron-core's `DType.optimal_dtype`: uint16 below 65,500 entries, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedWriter:
    """Documents appended in order (`add`), then `finalize(idx_path)` writes the index."""

    def __init__(self, bin_path: str, vocab_size: int | None):
        self.dtype = token_dtype(vocab_size)
        self.data = open(bin_path, "wb")
        self.lengths: list[np.ndarray] = []  # int32 sequence lengths, a chunk at a time
        self.document_ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.sequences = 0

    def add(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
            sequences_per_document: np.ndarray) -> None:
        """Documents: their tokens end to end, each sequence's length, each document's number
        of sequences (0 for an empty document, which still gets its index entry)."""
        self.data.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self.lengths.append(np.asarray(sequence_lengths, dtype=np.int32))
        ends = self.sequences + np.cumsum(sequences_per_document, dtype=np.int64)
        self.document_ends.append(ends)
        self.sequences += int(sequence_lengths.size)

    def finalize(self, idx_path: str) -> None:
        self.data.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(self.dtype).itemsize,
                      out=pointers[1:])
        documents = np.concatenate(self.document_ends)
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", documents.size))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())

    def close(self) -> None:
        self.data.close()
