"""A step's block tables gathered from a persistent host table (model.layout's part).

HostBlockTable mirrors the KV manager's per-sequence block lists in one int64 CPU tensor,
one row per sequence, written only where a list has grown since the last step (a block
every block_size tokens of a decode), so a step's [B, W] table is one index_select over
its chunks' rows: no list of every sequence's whole table is sliced, padded, flattened
and converted each step. It reads those lists and never changes them (which blocks a
sequence gets is kv_cache.py's decision) and relies on their contract: a sequence's list
only grows by appending while it is the same object (a new allocation is a new list).
Rows of sequences that are gone are taken back when the rows run out; nothing here
grows with a sequence's history beyond its own row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostBlockTable:
    def __init__(self, rows: int = 8, cols: int = 8) -> None:
        self._table = torch.zeros((rows, cols), dtype=torch.long, device="cpu")
        self._row_of: dict[str, int] = {}
        self._seq_of: list[str | None] = [None] * rows
        self._owner: list[list[int] | None] = [None] * rows  # the list a row mirrors
        self._written: list[int] = [0] * rows  # leading entries of the row taken from it
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self.entries_written = 0  # block ids copied into the table so far (tests read it)

    @property
    def num_rows(self) -> int:
        return self._table.shape[0]

    @property
    def num_cols(self) -> int:
        return self._table.shape[1]

    def gather(
        self, seq_ids: list[str], tables: list[list[int]], blocks: list[int]
    ) -> torch.Tensor:
        """[len(seq_ids), max(blocks)] int64 on the CPU: row i holds tables[i][:blocks[i]]
        (the blocks chunk i reads), zero-padded, as the lists would give it."""
        rows: list[int] = []
        short: list[int] = []  # chunks whose table holds more blocks than they read
        for i, (seq_id, table) in enumerate(zip(seq_ids, tables, strict=True)):
            row = self._row_of.get(seq_id)
            if row is None or self._owner[row] is not table:
                row = self._claim(seq_id, table, seq_ids)
            n = len(table)
            if n != self._written[row]:
                self._write(row, table)
            if blocks[i] < n:
                short.append(i)
            rows.append(row)
        width = max(blocks, default=0)
        out = self._table[:, :width].index_select(
            0, torch.tensor(rows, dtype=torch.long, device="cpu")
        )
        for i in short:
            out[i, blocks[i] :] = 0
        return out

    def _claim(self, seq_id: str, table: list[int], step_ids: list[str]) -> int:
        """A zeroed row for seq_id mirroring `table` (its old row if it had one)."""
        row = self._row_of.get(seq_id)
        if row is None:
            if not self._free:
                self._release_absent(step_ids)
            if not self._free:
                self._grow_rows()
            row = self._free.pop()
            self._row_of[seq_id] = row
            self._seq_of[row] = seq_id
        self._table[row].zero_()
        self._owner[row] = table
        self._written[row] = 0
        return row

    def _release_absent(self, step_ids: list[str]) -> None:
        """Take back the rows of every sequence that is not in this step."""
        present = set(step_ids)
        for seq_id, row in list(self._row_of.items()):
            if seq_id not in present:
                del self._row_of[seq_id]
                self._seq_of[row] = None
                self._owner[row] = None
                self._written[row] = 0
                self._free.append(row)

    def _grow_rows(self) -> None:
        old = self.num_rows
        grown = torch.zeros((2 * old, self.num_cols), dtype=torch.long, device="cpu")
        grown[:old] = self._table
        self._table = grown
        self._seq_of += [None] * old
        self._owner += [None] * old
        self._written += [0] * old
        self._free += list(range(2 * old - 1, old - 1, -1))

    def _write(self, row: int, table: list[int]) -> None:
        n, done = len(table), self._written[row]
        if n < done:  # not append-only after all: mirror it again from the start
            self._table[row].zero_()
            done = 0
        if n > self.num_cols:
            cols = max(n, 2 * self.num_cols)
            grown = torch.zeros((self.num_rows, cols), dtype=torch.long, device="cpu")
            grown[:, : self.num_cols] = self._table
            self._table = grown
        self._table[row, done:n] = torch.tensor(table[done:n], dtype=torch.long, device="cpu")
        self._written[row] = n
        self.entries_written += n - done


class TableRows(Sequence):
    """A [B, W] host tensor read as B lists of W ints, made on first read (the CUDA-graph
    buckets pad them; the CPU path reads the tensor alone)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._rows: list[list[int]] | None = None

    def _lists(self) -> list[list[int]]:
        if self._rows is None:
            self._rows = self.table.tolist()
        return self._rows

    def __len__(self) -> int:
        return self.table.shape[0]

    def __getitem__(self, i):
        return self._lists()[i]

    def __iter__(self):
        return iter(self._lists())
