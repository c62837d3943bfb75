"""What a document's text may be: a parquet text column's type (checked when the corpus is
planned, before any work) and a row's value (a null row is counted as one, a value that is not
text is one line naming where). jsonl rows check themselves (formats/jsonl.py)."""

from __future__ import annotations

from ddpgpt.errors import UserError

FIX = "name the text column with --text-field"


def is_text_type(arrow_type) -> bool:
    """A parquet column whose values are str in Python (or all null)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or pa.types.is_string_view(arrow_type) or pa.types.is_null(arrow_type))


def check_parquet_column(path, name: str, arrow_type, chat: bool = False) -> None:
    """Text, or with `chat` (prepare --chat) a list (of messages)."""
    if chat:
        import pyarrow as pa

        if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
            raise UserError(f"{path}: column {name!r} holds {arrow_type} values, not a list of "
                            "messages; name the conversations' column with --text-field")
        return
    if not is_text_type(arrow_type):
        import pyarrow as pa

        listed = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
        chat = " (conversations: prepare them with --chat)" \
            if listed and pa.types.is_struct(arrow_type.value_type) else ""  # of messages
        raise UserError(f"{path}: column {name!r} holds {arrow_type} values, not text{chat}; "
                        f"{FIX}")


def check_value(where: str, name: str, value) -> None:
    """A row's text from a source whose values are not typed up front (hf: datasets)."""
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: a row's {name!r} is {type(value).__name__}, not text; {FIX}")
