"""Parquet: each row's text column (`--text-field`) is one document; each row group is one unit,
read with pyarrow one record batch at a time (never a whole file, never a whole row group's
Python strings). The column's type is checked when the corpus is planned (columns.py); a null row
is counted, not a document.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ddpgpt.data import columns
from ddpgpt.data.formats.base import Format, Unit, UnitStats, first_line
from ddpgpt.errors import UserError
from ddpgpt.files import require

BATCH_ROWS = 1024


class Parquet(Format):
    name = "parquet"
    conversations = True

    def claims(self, path: Path) -> bool:
        return path.name.lower().endswith(".parquet")

    def plan_file(self, path: Path, size: int, record: dict, text_field: str,
                  chat: bool = False) -> list[Unit]:
        record["row_groups"] = _row_groups(path, text_field, chat)
        return [Unit(self.name, (str(path),), i) for i in range(record["row_groups"])]

    def records(self, unit: Unit, field: str, skip_bad: bool,
                stats: UnitStats) -> Iterator[tuple[str, object]]:
        for i, value in enumerate(self.texts(unit, field, skip_bad, stats)):
            yield f"{unit.paths[0]}: row group {unit.start}, row {i}", value

    def texts(self, unit: Unit, text_field: str, skip_bad: bool,
              stats: UnitStats) -> Iterator[str | None]:
        pq = _pyarrow()
        path = unit.paths[0]
        try:
            f = pq.ParquetFile(path)
            batches = f.iter_batches(batch_size=BATCH_ROWS, row_groups=[unit.start],
                                     columns=[text_field])
            for batch in batches:
                yield from batch.column(0).to_pylist()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{path}: row group {unit.start} cannot be read ({first_line(e)}); "
                            "download the file again or remove it from the sources") from None


def _row_groups(path: Path, text_field: str, chat: bool = False) -> int:
    pq = _pyarrow()
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({first_line(e)}); download it "
                        "again or remove it from the sources") from None
    names = meta.schema_arrow.names
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); "
                        "name the text column with --text-field")
    columns.check_parquet_column(path, text_field, meta.schema_arrow.field(text_field).type,
                                 chat)
    return meta.num_row_groups


def _pyarrow():
    return require("pyarrow.parquet", "data", "a parquet source")


ROW = Parquet()
