"""Reading input files into llama-index documents: one small reader per file type.

Owns: the readers for text/markdown, HTML, PDF and JSON/JSONL QA files (``READERS``), the doc id of
a QA passage, and :func:`read_file`, which reads one file through llama-index's
``SimpleDirectoryReader`` and turns every failure into :class:`SkipFile` with a reason users can
act on. A reader may also leave out part of a file it otherwise reads (a JSONL line that is not
UTF-8, not JSON or not a record): :func:`read_file` reports those parts beside the documents. Used
by :mod:`ragcache.ingest.ingestor`. Must not import vLLM, the engine, the pipeline, ``app/`` or ``ui/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from llama_index.core.readers.base import BaseReader
from llama_index.core.schema import Document

log = logging.getLogger("ragcache.readers")  # the name its lines have always carried

_SNIFF_BYTES = 8192


class _NoReadersFileWarning(logging.Filter):
    """Drop llama-index's warning that llama-index-readers-file is missing: every suffix we accept
    has a reader in :data:`READERS`, and SimpleDirectoryReader.load_file repeats it per file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "llama-index-readers-file" not in str(record.msg)


logging.getLogger("llama_index.core.readers.file.base").addFilter(_NoReadersFileWarning())


class SkipFile(Exception):
    """Raised by a reader: this input cannot be ingested; ``str(exc)`` is the reason users see."""


# ------------------------------------------------------------------------------------ readers


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise SkipFile("binary file (NUL bytes), not text")
    return data


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SkipFile(f"undecodable text: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _read_text_bytes(path: Path) -> str:
    return _decode(_read_bytes(path))


def _require_text(text: str) -> str:
    if not text.strip():
        raise SkipFile("empty file (no text)")
    return text


def _file_doc(path: Path, text: str, title: str, extra_info: dict | None) -> Document:
    return Document(id_=str(path), text=text, metadata={**(extra_info or {}), "title": title})


class TextReader(BaseReader):
    """Plain text and Markdown: strict UTF-8, one document per file, title = file stem."""

    def load_data(self, file: Path, extra_info: dict | None = None) -> list[Document]:
        text = _require_text(_read_text_bytes(Path(file)))
        return [_file_doc(Path(file), text, Path(file).stem, extra_info)]


class HtmlReader(BaseReader):
    """HTML with BeautifulSoup: visible text (no script/style), title = <title> or file stem."""

    def load_data(self, file: Path, extra_info: dict | None = None) -> list[Document]:
        from bs4 import BeautifulSoup

        soup = BeautifulSoup(_read_text_bytes(Path(file)), "html.parser")
        for tag in soup(["script", "style", "noscript", "template"]):
            tag.decompose()
        title = soup.title.get_text(strip=True) if soup.title else ""
        if soup.title:
            soup.title.decompose()
        lines = (line.strip() for line in soup.get_text("\n").splitlines())
        text = _require_text("\n".join(line for line in lines if line))
        return [_file_doc(Path(file), text, title or Path(file).stem, extra_info)]


class PdfReader(BaseReader):
    """PDF with pypdf: the pages' text joined by blank lines, one document per file."""

    def load_data(self, file: Path, extra_info: dict | None = None) -> list[Document]:
        import pypdf

        path = Path(file)
        with path.open("rb") as f:
            if not f.read(1024).lstrip().startswith(b"%PDF-"):
                raise SkipFile("unreadable PDF: no %PDF- header (not a PDF file)")
        try:
            pdf = pypdf.PdfReader(path)
            if pdf.is_encrypted and not pdf.decrypt(""):
                raise SkipFile("unreadable PDF: encrypted")
            pages = [page.extract_text() or "" for page in pdf.pages]
            meta_title = (pdf.metadata.title if pdf.metadata else None) or ""
        except SkipFile:
            raise
        except Exception as exc:  # pypdf raises many types for damaged files
            raise SkipFile(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
        text = "\n\n".join(p.strip() for p in pages if p.strip())
        if not text:
            raise SkipFile(f"unreadable PDF: no extractable text in {len(pages)} page(s) (scanned?)")
        return [_file_doc(path, text, str(meta_title).strip() or path.stem, extra_info)]


def passage_doc_id(title: str, text: str) -> str:
    """Document id of a QA passage: 16 hex chars of sha256(title, text)."""
    return hashlib.sha256(f"{title}\x00{text}".encode("utf-8")).hexdigest()[:16]


class _Unusable:
    """A JSONL line or JSON list item left out, and why (``"invalid JSON (...)"``)."""

    def __init__(self, reason: str):
        self.reason = reason


def _jsonl_lines(data: bytes) -> list[tuple[str, "object | _Unusable"]]:
    """``("line N", value)`` for every non-blank line of a JSONL file (lines counted from 1 as
    editors do), decoded one line at a time: a line that is not UTF-8 or not JSON becomes an
    :class:`_Unusable` naming the byte or the JSON error, and the other lines are kept."""
    out: list[tuple[str, object | _Unusable]] = []
    for n, raw in enumerate(data.split(b"\n"), 1):  # JSON Lines separates by \n only (U+2028 may sit in a string)
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            out.append((f"line {n}", _Unusable(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")))
            continue
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as exc:
            out.append((f"line {n}", _Unusable(f"invalid JSON ({exc.msg}: column {exc.colno})")))
    return out


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true/false", type(None): "null"}
_RECORD = "expected an object with ctxs: [{title, text}] or a text string"


def _passages(rec: object) -> "list[dict] | _Unusable":
    """The passages ``{title, text}`` of one record (a QA record's ``ctxs``, or the record itself
    when it has a ``text``), or why it has none."""
    if not isinstance(rec, dict):
        return _Unusable(f"{_JSON_TYPES.get(type(rec), 'a JSON value')}, not a record ({_RECORD})")
    if "ctxs" in rec:
        ctxs = rec["ctxs"]
        if not isinstance(ctxs, list):
            return _Unusable(f"ctxs is {_JSON_TYPES.get(type(ctxs), 'a JSON value')}, not a list of "
                             "{title, text} passages")
        found = [p for p in ctxs if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"].strip()]
        return found or _Unusable("no passage in ctxs has text")
    if not isinstance(rec.get("text"), str):
        return _Unusable(f"an object without ctxs or text ({_RECORD})")
    return [rec] if rec["text"].strip() else _Unusable("empty text")


def _empty_json(value: object) -> bool:
    """Whether a JSON value holds nothing to index: null, a blank string, or a list or object of only
    such values (``[]``, ``{}``, ``[[], {}]``)."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(_empty_json(v) for v in value)
    if isinstance(value, dict):
        return all(_empty_json(v) for v in value.values())
    return False


def _describe_empty(value: object) -> str:
    """``[]`` -> "an empty list", ``[{}]`` -> "a list of empty values only" (``value``: :func:`_empty_json`)."""
    if isinstance(value, (list, dict)) and value:
        return f"{_JSON_TYPES[type(value)]} of empty values only"
    return {list: "an empty list", dict: "an empty object", str: "an empty string"}.get(type(value), "null")


class JsonRecordsReader(BaseReader):
    """JSON (a record or a list of records) and JSONL (one record per line).

    Records with ``ctxs: [{title, text}]`` (the QA sets) give one document per distinct passage;
    records with a ``text`` string give one document each. In a file with at least one such record,
    whatever else it holds is left out and named in ``left_out`` (a JSONL line that is not UTF-8,
    not JSON or not a record; a list item that is not a record) and the records are read. A file
    that holds only empty JSON (``[]``, ``{}``, ``null``, ``""``, or lists and objects of those; in
    JSONL, on every line) has nothing to ingest and is skipped (:class:`SkipFile`). Any other file
    without a record is indexed as its text (JSONL lines that are not JSON are still named).
    Passage documents get :func:`passage_doc_id` as id and keep their title.

    Attributes:
        left_out: what was left out of the files this reader read, one line each
            (``"line 2: invalid JSON (Expecting value: column 1)"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.left_out: list[str] = []

    def load_data(self, file: Path, extra_info: dict | None = None) -> list[Document]:
        path = Path(file)
        if path.suffix.lower() == ".jsonl":
            data = _read_bytes(path)
            items = _jsonl_lines(data)
            if items and all(not isinstance(rec, _Unusable) and _empty_json(rec) for _, rec in items):
                raise SkipFile("nothing to ingest: every line holds empty JSON ([], {}, null or \"\"; no records, "
                               "no text)")
        else:
            data = _read_text_bytes(path)
            try:
                loaded = json.loads(data)
            except json.JSONDecodeError as exc:
                raise SkipFile(f"invalid JSON: {exc}") from None
            if _empty_json(loaded):
                raise SkipFile(f"nothing to ingest: the file holds {_describe_empty(loaded)} (no records, no text)")
            items = [(f"item {i}", rec) for i, rec in enumerate(loaded, 1)] if isinstance(loaded, list) else [
                ("the file", loaded)]
        docs: dict[str, Document] = {}
        unusable: list[str] = []
        for where, rec in items:
            passages = rec if isinstance(rec, _Unusable) else _passages(rec)
            if isinstance(passages, _Unusable):
                unusable.append(f"{where}: {passages.reason}")
                continue
            for p in passages:
                title = str(p.get("title") or "")
                doc_id = passage_doc_id(title, p["text"])
                if doc_id not in docs:
                    docs[doc_id] = Document(id_=doc_id, text=p["text"], metadata={**(extra_info or {}), "title": title})
        if docs:
            self.left_out.extend(unusable)
            return list(docs.values())
        # no record: the file is indexed as text (a JSON file of other shapes)
        not_json = [f"{where}: {rec.reason}" for where, rec in items if isinstance(rec, _Unusable)]
        if isinstance(data, bytes):
            if items and len(not_json) == len(items):
                more = f", and {len(not_json) - 1} more line(s)" if len(not_json) > 1 else ""
                raise SkipFile(f"no line is JSON ({not_json[0]}{more})")
            data = _decode(data)
        self.left_out.extend(not_json)
        return [_file_doc(path, _require_text(data), path.stem, extra_info)]


#: file suffix -> llama-index reader (passed to SimpleDirectoryReader as file_extractor)
READERS: dict[str, type[BaseReader]] = {
    ".txt": TextReader, ".md": TextReader, ".markdown": TextReader,
    ".html": HtmlReader, ".htm": HtmlReader,
    ".pdf": PdfReader,
    ".json": JsonRecordsReader, ".jsonl": JsonRecordsReader,
}


def read_file(path: Path, left_out: list[str] | None = None) -> list[Document]:
    """Documents of one input file through llama-index's SimpleDirectoryReader.

    Args:
        left_out: where to add, one line each, the parts of the file left out while the rest was
            read (``"line 2: invalid JSON (...)"``, ``"line 3: not UTF-8 (...)"``, ``"line 4: a
            number, not a record (...)"``; see :class:`JsonRecordsReader`).

    Raises:
        SkipFile: the file cannot be ingested (unsupported type, binary, undecodable, empty,
            unreadable PDF, invalid JSON, a JSONL file without one JSON line); the message is the reason.
    """
    from llama_index.core import SimpleDirectoryReader

    if path.suffix.lower() not in READERS:
        raise SkipFile(f"unsupported file type {path.suffix or '(none)'!r} (supported: {', '.join(READERS)})")
    extractor = {suffix: cls() for suffix, cls in READERS.items()}
    try:
        docs = SimpleDirectoryReader.load_file(
            path, file_metadata=lambda p: {"source": p}, file_extractor=extractor,
            errors="strict", raise_on_error=True,
        )
        if left_out is not None:
            left_out.extend(getattr(extractor[path.suffix.lower()], "left_out", ()))
        return docs
    except Exception as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, SkipFile):
            raise cause from None
        if isinstance(cause, OSError):
            raise SkipFile(f"cannot read: {cause.strerror or cause}") from None
        raise SkipFile(f"cannot read: {type(cause).__name__}: {cause}") from None


