"""A sixth input format of `prepare`, whole: its module and its row of the format table, added
from outside the package. A `.cards` file is a deck of cards (fortune's format): documents
separated by lines `%%`; a blank card is counted as empty, not a document; each file is one unit.
Its files have no fields, so it refuses --text-field and --skip-bad-rows. Run as
`python -m tests.e2e.toy_format prepare ...`: the row is registered, then ddpgpt's own command
line runs, with its worker processes."""

import re
import sys
from pathlib import Path

from ddpgpt.data.formats.base import Format
from ddpgpt.data.formats.table import FORMATS

SEPARATOR = re.compile(r"^%%\n", re.MULTILINE)


class Cards(Format):
    name = "cards"
    refuses = ("text_field", "skip_bad_rows")

    def claims(self, path: Path) -> bool:
        return path.name.endswith(".cards")

    def texts(self, unit, text_field, skip_bad, stats):
        yield from cards(Path(unit.paths[0]).read_text(encoding="utf-8"))


def cards(text: str) -> list[str]:
    """A deck's cards, in order, as its documents ("" for a blank one)."""
    return SEPARATOR.split(text)


ROW = Cards()

if __name__ == "__main__":
    FORMATS[ROW.name] = ROW
    from ddpgpt.cli import main

    main(sys.argv[1:])
