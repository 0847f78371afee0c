"""Reading input files into llama-index documents: one small reader per file type.

Owns: the readers for text/markdown, HTML, PDF and JSON/JSONL QA files (``READERS``), the doc id of
a QA passage, and :func:`read_file`, which reads one file through llama-index's
``SimpleDirectoryReader`` and turns every failure into :class:`SkipFile` with a reason users can
act on. A reader may also leave out part of a file it otherwise reads (a JSONL line that is not
JSON): :func:`read_file` reports those parts beside the documents. Used by :mod:`ragcache.ingest`. Must not import vLLM, the engine, the pipeline, ``app/``
or ``ui/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from llama_index.core.readers.base import BaseReader
from llama_index.core.schema import Document

log = logging.getLogger(__name__)

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


def _read_text_bytes(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise SkipFile("binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SkipFile(f"undecodable text: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


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


def _jsonl_records(raw: str, left_out: list[str]) -> list:
    """The records of a JSONL text; a line that is not JSON is left out and named in ``left_out``
    (``"line 2: invalid JSON (Expecting value: column 1)"``, lines counted from 1 as editors do).

    Raises:
        SkipFile: no line is JSON.
    """
    records, bad = [], []
    for n, line in enumerate(raw.split("\n"), 1):  # JSON Lines separates by \n only (U+2028 may sit in a string)
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            bad.append(f"line {n}: invalid JSON ({exc.msg}: column {exc.colno})")
    if bad and not records:
        more = f", and {len(bad) - 1} more line(s)" if len(bad) > 1 else ""
        raise SkipFile(f"invalid JSON on every line ({bad[0]}{more})")
    left_out.extend(bad)
    return records


class JsonRecordsReader(BaseReader):
    """JSON (a record or a list of records) and JSONL (one record per line).

    Records with ``ctxs: [{title, text}]`` (the QA sets) give one document per distinct passage;
    records with a ``text`` string give one document each; any other JSON is indexed as the file's
    text. Passage documents get :func:`passage_doc_id` as id and keep their title. A JSONL line
    that is not JSON is left out (named in ``left_out``) and the other lines are read.

    Attributes:
        left_out: what was left out of the files this reader read, one line each.
    """

    def __init__(self) -> None:
        super().__init__()
        self.left_out: list[str] = []

    def load_data(self, file: Path, extra_info: dict | None = None) -> list[Document]:
        path = Path(file)
        raw = _read_text_bytes(path)
        if path.suffix.lower() == ".jsonl":
            records = _jsonl_records(raw, self.left_out)
        else:
            try:
                loaded = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SkipFile(f"invalid JSON: {exc}") from None
            records = loaded if isinstance(loaded, list) else [loaded]
        docs: dict[str, Document] = {}
        for rec in records:
            if not isinstance(rec, dict):
                continue
            passages = rec.get("ctxs") if isinstance(rec.get("ctxs"), list) else [rec]
            for p in passages:
                if not isinstance(p, dict) or not isinstance(p.get("text"), str) or not p["text"].strip():
                    continue
                title = str(p.get("title") or "")
                doc_id = passage_doc_id(title, p["text"])
                if doc_id not in docs:
                    docs[doc_id] = Document(id_=doc_id, text=p["text"], metadata={**(extra_info or {}), "title": title})
        if docs:
            return list(docs.values())
        return [_file_doc(path, _require_text(raw), path.stem, extra_info)]


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
            read (a JSONL line that is not JSON: ``"line 2: invalid JSON (...)"``).

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


