"""Parquet files and Hugging Face datasets saved with ``save_to_disk``, read row by row (1-based ``path: row N``).

pyarrow and datasets are optional (``pip install 'budgetq[formats]'``) and imported only here, only when such an
input is given: reading JSONL never imports them. Only the columns the field mapping names are converted to
Python, so a dataset's other columns (images, long metadata) cost nothing and cannot break the read.

A file or dataset without any of the mapped record columns is refused as a whole (``path: no "messages", ...
column``): every row would fail the same way. A row with text that is not valid UTF-8 is a bad row.

Hugging Face datasets are loaded strictly offline: ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set to 1
before ``datasets`` is imported, and only ``datasets.load_from_disk`` is called, which reads local files.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from producer.inputs.records import Collector, FieldMapping, InputError, Problem, RecordError, file_error, normalize

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_ROWS = 4096
"""Rows converted to Python at a time: bounds the memory of the conversion, not of the samples kept."""
INSTALL_HINT = "pip install 'budgetq[formats]'"


def read_parquet(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    """Read a Parquet file into ``sink``; a file that cannot be read, or has no record column, raises InputError."""
    where = str(path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing(where, "reading Parquet needs pyarrow") from None
    try:
        f = open(path, "rb")  # opened here, so a missing or unreadable file reads as for every other format
    except (OSError, ValueError) as e:
        raise file_error(where, e) from None
    with f:
        try:
            parquet = pq.ParquetFile(f)
            columns = _columns(where, parquet.schema_arrow.names, mapping)
            _read_batches(parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns), where, sink, mapping)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(where, "not a readable Parquet file", e) from None


def read_saved(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    """Read a folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk`` with one split)."""
    where = str(path)
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # strictly offline: set before datasets reads its config at import
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        raise _missing(where, "reading a Hugging Face dataset folder needs the datasets package") from None
    try:
        loaded = datasets.load_from_disk(where)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise _unreadable(where, "cannot load the saved Hugging Face dataset", e) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if len(splits) != 1:
            example = path / ("train" if "train" in splits else splits[0])
            raise InputError([Problem(where, None, f"a DatasetDict with splits {', '.join(splits)}: give one "
                                                   f"split's folder, e.g. {example}")])
        loaded = loaded[splits[0]]
    if not isinstance(loaded, datasets.Dataset):
        raise InputError([Problem(where, None, f"not a Dataset ({type(loaded).__name__})")])
    columns = _columns(where, loaded.column_names, mapping)
    try:
        tables = loaded.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
        _read_batches(tables, where, sink, mapping)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(where, "cannot read the saved Hugging Face dataset", e) from None


def _columns(where: str, names: list[str], mapping: FieldMapping) -> list[str]:
    fields = mapping.record_fields
    columns = [name for name in (*fields, mapping.id_field, mapping.tools_field) if name in names]
    if not any(name in fields for name in columns):
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        raise InputError([Problem(where, None, f'no "{fields[0]}", "{fields[1]}" or "{fields[2]}" column '
                                               f"(columns: {shown or 'none'})")])
    return columns


def _read_batches(batches: Iterable[pa.RecordBatch | pa.Table], where: str, sink: Collector,
                  mapping: FieldMapping) -> None:
    row = 0
    for batch in batches:
        for obj in _rows(batch):
            row += 1
            if isinstance(obj, RecordError):
                sink.reject(where, row, "row", obj.reason)
                continue
            try:
                # Arrow strings are valid UTF-8, so no unpaired surrogate can be in them.
                sample_id, messages, tools = normalize(obj, mapping, surrogates=False, columnar=True)
            except RecordError as e:
                sink.reject(where, row, "row", e.reason)
                continue
            sink.add(where, row, "row", sample_id, messages, tools)


def _rows(batch: pa.RecordBatch | pa.Table) -> list[Any]:
    """The batch's rows as dicts; a row that cannot be converted (bad UTF-8 in a string) becomes a RecordError."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        pass
    rows: list[Any] = []
    for i in range(batch.num_rows):
        try:
            rows.extend(batch.slice(i, 1).to_pylist())
        except UnicodeDecodeError as e:
            rows.append(RecordError(f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} in a string column)"))
    return rows


def _missing(where: str, what: str) -> InputError:
    return InputError([Problem(where, None, f"{what}: {INSTALL_HINT}")])


def _unreadable(where: str, what: str, e: Exception) -> InputError:
    detail = " ".join(str(e).split()) or type(e).__name__
    if len(detail) > 200:
        detail = detail[:200] + "..."
    return InputError([Problem(where, None, f"{what} ({detail})")])
