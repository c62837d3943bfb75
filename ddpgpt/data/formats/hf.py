"""Hugging Face datasets, streamed: `hf:NAME[:CONFIG][:SPLIT]` (the split defaults to train),
each row's text column (`--text-field`) one document (or, prepare --chat, one conversation), the
whole dataset one unit. Needs the hf
extra (`datasets`); offline, HF_DATASETS_OFFLINE=1 reads a cached copy.
"""

from __future__ import annotations

from collections.abc import Iterator

from ddpgpt.data.formats.base import Format, Unit, UnitStats
from ddpgpt.errors import UserError
from ddpgpt.files import require


class Hf(Format):
    name = "hf"
    prefix = "hf:"
    conversations = True

    def stream(self, spec: str) -> tuple:
        """(name, config, split) of `hf:NAME[:CONFIG][:SPLIT]`."""
        name, config, split = (spec[len(self.prefix):].split(":") + [None, None])[:3]
        if not name:
            raise UserError(f"source {spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
        return name, config or None, split or "train"

    def where(self, unit: Unit) -> str:
        return f"hf:{unit.paths[0]}"

    def texts(self, unit: Unit, text_field: str, skip_bad: bool,
              stats: UnitStats) -> Iterator[str]:
        return hf_texts(*unit.paths, text_field=text_field)

    def records(self, unit: Unit, field: str, skip_bad: bool,
                stats: UnitStats) -> Iterator[tuple[str, object]]:
        for i, value in enumerate(hf_texts(*unit.paths, text_field=field)):
            yield f"hf:{unit.paths[0]} row {i}", value


def hf_texts(name: str, config: str | None, split: str,
             text_field: str = "text") -> Iterator[str]:
    datasets = require("datasets", "hf", f"source hf:{name}")
    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in rows:
            if text_field not in row:
                raise UserError(f"hf:{name} rows have no {text_field!r} column (columns: "
                                f"{', '.join(row)}); name the text column with --text-field")
            yield row[text_field]
    except UserError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"cannot stream hf:{name} ({first[:200]}); check the name and the network, "
            "or set HF_DATASETS_OFFLINE=1 to use a cached copy"
        ) from None


ROW = Hf()
