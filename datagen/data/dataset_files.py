"""Where a dataset's rows are: a JSONL file, a JSON array file, a folder of them, or a Hugging Face
dataset on disk; recognised from the path and the files, with nothing to pass.

The dataset is named by its path, optionally followed by ``#`` and options, as a URL's fragment:
``DIR#split=train&column=conversations&format=sharegpt``. ``split`` picks a split of a Hugging Face
dataset that has several, ``column`` the column that holds the chats (when it is not one of the
names a format has), ``format`` the row format every row must be of
(``datagen.data.row_formats.RowFormat``).

A single JSONL file is planned as it is read, in byte ranges (``datagen.data.planning``). Every
other container is read whole here, in the planning process, into ``Records``: rows parsed, each
with the file and line (or row) it came from, and the fingerprint of what was read. Nothing is
fetched over the network: ``datasets`` reads local files only.
"""

from __future__ import annotations

import bisect
import enum
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from datagen.data.row_formats import FORMAT_KEYS, RowFormat
from datagen.errors import DatasetError


class Container(str, enum.Enum):
    """How a dataset's rows are stored."""

    JSONL = "jsonl"  # one JSON object per line
    JSON = "json"  # a JSON array of objects
    FOLDER = "folder"  # .jsonl and .json files, read in sorted path order
    HF_DISK = "hf-disk"  # ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
    PARQUET = "parquet"  # .parquet files (a file, or a folder of them)
    ARROW = "arrow"  # .arrow files (a file, or a folder of them)


OPTIONS = ("split", "column", "format")
CHAT_FILES = (".jsonl", ".json")
HF_MARKERS = ("dataset_dict.json", "state.json")
TABLE_FILES = {".parquet": Container.PARQUET, ".arrow": Container.ARROW}
HINT = ("pass a JSONL or JSON file, a folder of them, or a Hugging Face dataset saved on disk "
        "(save_to_disk, or .parquet / .arrow files)")


@dataclass(frozen=True)
class DatasetRef:
    """A dataset as the spec names it: its path and the options after ``#``."""

    text: str  # as written
    path: Path
    split: str | None = None
    column: str | None = None
    format: RowFormat | None = None

    @property
    def has_options(self) -> bool:
        return self.split is not None or self.column is not None or self.format is not None


def parse_ref(dataset: str | Path) -> DatasetRef:
    """The path and options of a dataset name. Raises DatasetError for an unknown option."""
    text = str(dataset)
    base, sep, frag = text.partition("#")
    if not sep:
        return DatasetRef(text, Path(text))
    opts = dict(parse_qsl(frag, keep_blank_values=True))
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown or not opts:
        raise DatasetError(f"unknown dataset options {unknown or [frag]}", path=text,
                           hint=f"options after '#' are {', '.join(OPTIONS)}, e.g. data/chats#split=train&column=messages")
    fmt = opts.get("format")
    if fmt is not None and fmt not in {f.value for f in RowFormat}:
        raise DatasetError(f"unknown row format {fmt!r}", path=text,
                           hint=f"format is one of {', '.join(f.value for f in RowFormat)}")
    return DatasetRef(text, Path(base), opts.get("split") or None, opts.get("column") or None,
                      RowFormat(fmt) if fmt else None)


def exists(ref: DatasetRef) -> bool:
    """Whether the dataset's path is there to read: a file or a folder, as ``container`` takes it
    (the options after ``#`` are no part of the path). What a folder holds is ``container``'s to say."""
    return ref.path.is_file() or ref.path.is_dir()


def container(ref: DatasetRef) -> Container:
    """How the rows are stored, from the path and its files (reads at most a file's first bytes).

    Raises:
        DatasetError: the path does not exist, or holds nothing a dataset is made of.
    """
    p = ref.path
    if p.is_file():
        if p.suffix in TABLE_FILES:
            return TABLE_FILES[p.suffix]
        return Container.JSON if p.suffix != ".jsonl" and _first_byte(p) == b"[" else Container.JSONL
    if not exists(ref):
        said = "dataset path is neither a file nor a folder" if p.exists() else "dataset does not exist"
        raise DatasetError(said, path=str(p), hint=HINT)
    if any((p / m).is_file() for m in HF_MARKERS):
        return Container.HF_DISK
    names = {f.suffix for f in _files(p)}
    tables = [c for s, c in TABLE_FILES.items() if s in names]
    if tables:
        return tables[0]
    if names & set(CHAT_FILES):
        return Container.FOLDER
    raise DatasetError("the folder holds no .jsonl, .json, .parquet or .arrow file and is no saved Hugging Face "
                       "dataset", path=str(p), hint=HINT)


def _first_byte(p: Path) -> bytes:
    with p.open("rb") as f:
        while (b := f.read(1)) and b in b" \t\r\n\xef\xbb\xbf":
            pass
    return b


def _files(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in
                                                                      f.relative_to(p).parts))


@dataclass
class Records:
    """Rows read whole (every container but a single JSONL file)."""

    container: Container
    rows: list[dict]
    fingerprint: str  # sha256 of what was read (``fingerprint``)
    origins: list[tuple[str, int]]  # (file, its first row) per file read, in row order
    lines: list[list[int]] | None = None  # per file: the 1-based line each row starts on (None: a table)

    @functools.cached_property
    def _firsts(self) -> list[int]:
        return [first for _, first in self.origins]

    def where(self, row: int) -> tuple[str, int]:
        """(file, 1-based line) of a row; (dataset, 1-based row) for a table."""
        k = max(bisect.bisect_right(self._firsts, row) - 1, 0)
        path, first = self.origins[k]
        return path, (self.lines[k][row - first] if self.lines is not None else row - first + 1)


def fingerprint(ref: DatasetRef) -> str:
    """sha256 of a dataset as it is now: a JSONL or JSON file's bytes; else over every file read
    (relative path and sha256) and the options."""
    from datagen.data.checksums import sha256_file

    c = container(ref)
    if ref.path.is_file() and c in (Container.JSONL, Container.JSON) and not ref.has_options:
        return sha256_file(ref.path)
    h = hashlib.sha256(_options_key(ref))
    for f in _data_files(ref, c):
        h.update(_file_key(ref, f, bytes.fromhex(sha256_file(f))))
    return h.hexdigest()


def _options_key(ref: DatasetRef) -> bytes:
    return json.dumps({"split": ref.split, "column": ref.column, "format": ref.format and ref.format.value},
                      sort_keys=True).encode()


def _file_key(ref: DatasetRef, f: Path, digest: bytes) -> bytes:
    rel = f.name if ref.path.is_file() else f.relative_to(ref.path).as_posix()
    return rel.encode() + b"\0" + digest


def _data_files(ref: DatasetRef, c: Container) -> list[Path]:
    if ref.path.is_file():
        return [ref.path]
    if c is Container.HF_DISK:
        return _files(ref.path)
    if c is Container.FOLDER:
        return [f for f in _files(ref.path) if f.suffix in CHAT_FILES]
    suffix = next(s for s, k in TABLE_FILES.items() if k is c)
    files = [f for f in _files(ref.path) if f.suffix == suffix]
    if ref.split is not None:
        files = [f for f in files if ref.split in f.relative_to(ref.path).parts[:-1] or f.stem.startswith(ref.split)]
        if not files:
            raise DatasetError(f"no {suffix} file of split {ref.split!r}", path=str(ref.path),
                               hint="name the split as the files' folder or name prefix says it, or leave split out")
    return files


def read_records(ref: DatasetRef) -> Records:
    """Every row of a dataset that is not a single JSONL file, parsed, with where it came from.

    Raises:
        DatasetError: a file that is not JSON, a row that is not an object, an empty dataset, a
            split or column that is not there.
    """
    c = container(ref)
    if c in (Container.JSONL, Container.JSON, Container.FOLDER):
        return _read_json_files(ref, c)
    return _read_table(ref, c)


def _read_json_files(ref: DatasetRef, c: Container) -> Records:
    h = hashlib.sha256(_options_key(ref)) if not (ref.path.is_file() and not ref.has_options) else None
    whole = hashlib.sha256()
    rows: list[dict] = []
    origins, lines = [], []
    for f in _data_files(ref, c):
        data = f.read_bytes()
        whole.update(data)
        if h is not None:
            h.update(_file_key(ref, f, hashlib.sha256(data).digest()))
        objs, starts = (_json_array(data, path=str(f)) if container(DatasetRef(str(f), f)) is Container.JSON
                        else _jsonl(data, path=str(f)))
        origins.append((str(f), len(rows)))
        lines.append(starts)
        rows += objs
    rec = Records(c, rows, h.hexdigest() if h is not None else whole.hexdigest(), origins, lines)
    if ref.column is not None:
        rec.rows = [_named_column(ref, r, rec.where(i)) for i, r in enumerate(rows)]
    return _nonempty(rec, ref)


def _nonempty(rec: Records, ref: DatasetRef) -> Records:
    if not rec.rows:
        raise empty_dataset(ref.path)
    return rec


def _named_column(ref: DatasetRef, obj: dict, where: tuple[str, int]) -> dict:
    """A JSON row read from the column the options name (and its tools, system prompt or mask)."""
    if ref.column not in obj:
        raise DatasetError(f"row has no field {ref.column!r} (fields: {sorted(obj)})", path=where[0], line=where[1],
                           hint="name the field that holds the chats with #column=NAME, or leave column out")
    key = _format_field(ref, obj[ref.column])
    return {key: obj[ref.column], **{k: obj[k] for k in ("tools", "system", "loss_mask") if k in obj and k != ref.column}}


def _jsonl(data: bytes, *, path: str) -> tuple[list[dict], list[int]]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [parse_row(x, path=path, line=i + 1) for i, x in enumerate(lines)], list(range(1, len(lines) + 1))


def _json_array(data: bytes, *, path: str) -> tuple[list[dict], list[int]]:
    """The objects of a JSON array file and the line each starts on."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"not valid UTF-8 (byte {e.start})", path=path, hint="re-encode the file as UTF-8") from None
    decoder = json.JSONDecoder()
    i, line, objs, starts = text.index("[") + 1, 1, [], []
    ws = " \t\r\n"
    pos = 0
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if i < len(text) and text[i] == "]" and not objs:
            break
        line += text.count("\n", pos, i)
        pos = i
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DatasetError(f"malformed JSON ({e.msg})", path=path, line=text.count("\n", 0, e.pos) + 1,
                               hint="the file must be one JSON array of objects") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"a row must be a JSON object, got {type(obj).__name__}", path=path, line=line,
                               hint='write [{"messages": [...]}, ...]')
        objs.append(obj)
        starts.append(line)
        i = end
        while i < len(text) and text[i] in ws:
            i += 1
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        if i < len(text) and text[i] == "]" and not text[i + 1:].strip():
            break
        raise DatasetError("malformed JSON (expected ',' or the array's end)", path=path,
                           line=text.count("\n", 0, i) + 1, hint="the file must be one JSON array of objects")
    return objs, starts


def _read_table(ref: DatasetRef, c: Container) -> Records:
    table = _load_table(ref, c)
    cols = _columns(ref, list(table.column_names))
    rows = [_from_arrow(r) for r in table.select_columns(cols).to_list()]
    if ref.column is not None:
        rows = [{**{k: v for k, v in r.items() if k != ref.column}, _format_field(ref, r.get(ref.column)):
                 r.get(ref.column)} for r in rows]
    return _nonempty(Records(c, rows, fingerprint(ref), [(ref.text, 0)]), ref)


def _load_table(ref: DatasetRef, c: Container):
    """The split's rows as a ``datasets.Dataset`` (memory-mapped Arrow, read locally)."""
    import datasets

    if c is Container.HF_DISK:
        try:
            loaded = datasets.load_from_disk(str(ref.path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise DatasetError(f"not a readable Hugging Face dataset folder: {e}", path=str(ref.path),
                               hint="save it with Dataset.save_to_disk, or pass its .parquet / .arrow files") from e
        if isinstance(loaded, datasets.DatasetDict):
            splits = sorted(loaded)
            split = ref.split or (splits[0] if len(splits) == 1 else None)
            if split not in loaded:
                raise DatasetError(
                    f"the dataset has the splits {splits}" + (f", not {ref.split!r}" if ref.split else ""),
                    path=ref.text, hint=f"name one: {ref.path}#split={splits[0]}")
            return loaded[split]
        if ref.split is not None:
            raise DatasetError(f"the dataset has no splits, so no split {ref.split!r}", path=ref.text,
                               hint="leave split out")
        return loaded
    files = _data_files(ref, c)
    if c is Container.ARROW:
        parts = [datasets.Dataset.from_file(str(f)) for f in files]
    else:
        import pyarrow.parquet as pq

        parts = [datasets.Dataset(pq.read_table(f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _columns(ref: DatasetRef, names: list[str]) -> list[str]:
    """The columns read: the chats (or ids), and the tools, system prompt or mask beside them."""
    if ref.column is not None:
        if ref.column not in names:
            raise DatasetError(f"the dataset has no column {ref.column!r} (columns: {names})", path=ref.text,
                               hint="name one of its columns with #column=NAME")
        chat = ref.column
    else:
        found = [k for k in FORMAT_KEYS if k in names]
        if len(found) != 1:
            raise DatasetError(
                f"the dataset's columns {names} hold " + ("no " if not found else "more than one ") +
                f"chat or token column ({', '.join(FORMAT_KEYS)})", path=ref.text,
                hint=f"name the column that holds the chats: {ref.path}#column=NAME")
        chat = found[0]
    return [chat, *(k for k in ("tools", "system", "loss_mask") if k in names and k != chat)]


def _format_field(ref: DatasetRef, value) -> str:
    """The format's field for the value of a named column: the format named, else conversations for
    ShareGPT turns (``from``), data for UltraChat's strings, input_ids for ids, else messages."""
    if ref.format is not None:
        return next(k for k, f in FORMAT_KEYS.items() if f is ref.format)
    turn = value[0] if isinstance(value, list) and value else None
    if isinstance(turn, str):
        return "data"
    if isinstance(turn, int):
        return "input_ids"
    return "conversations" if isinstance(turn, dict) and "from" in turn else "messages"


def _from_arrow(value):
    """A value read from Arrow without the nulls Arrow fills in for keys that only some rows' objects
    have (a struct column has every key any row has)."""
    if isinstance(value, dict):
        return {k: _from_arrow(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_from_arrow(v) for v in value]
    return value


def parse_row(raw: bytes, *, path: str, line: int) -> dict:
    """One line of a JSONL file (with its line end, as read) as a JSON object, or the error that
    names what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"not valid UTF-8 (byte {e.start})", path=path, line=line,
            hint="re-encode the file as UTF-8",
        ) from None
    if not text.strip():
        raise DatasetError(
            "blank line", path=path, line=line,
            hint="remove blank lines: every line must be one JSON object",
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"malformed JSON ({e.msg} at column {e.colno})", path=path, line=line,
            hint="each line must be one complete JSON object",
        ) from None
    if not isinstance(obj, dict):
        raise DatasetError(
            f"a row must be a JSON object, got {type(obj).__name__}", path=path,
            line=line, hint='write {"messages": [...]} or {"input_ids": [...]}',
        )
    return obj


def empty_dataset(path: str | Path) -> DatasetError:
    return DatasetError("dataset is empty", path=str(path), hint="give at least one row")
