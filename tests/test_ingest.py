"""Ingest: real llama-index, real LLM tokenizer and embedding model, real files; no mocks.

Pins: chunk counts, incremental re-ingest, replacement of a changed file's chunks, --prune,
crash safety (failed embedding, failed KV hook, interrupted swap), the reasons bad inputs are
skipped for, the chunk-size bound, and the `ragcache ingest` command.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ragcache.config import ConfigError, Settings
from ragcache.index.faiss_index import Index
from ragcache.index.folder import previous_path, readable_path
from ragcache.index.manifest import IndexMismatchError
from ragcache.ingest.ingestor import Ingestor, KVPrecomputeError
from ragcache.ingest.readers import passage_doc_id
from tests.conftest import clear_ragcache_env, shared_data

HOTPOT = "hotpotqa/hotpotqa_distractor_100.json"  # under ../shared/data or $RAGCACHE_DATA_DIR
N_PASSAGES = 30


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    clear_ragcache_env(monkeypatch)
    monkeypatch.chdir(tmp_path)  # no ./settings.toml; relative index_dir lands in tmp_path


@pytest.fixture(scope="module")
def models():
    """The LLM tokenizer and the embedding model, loaded once for the module."""
    from ragcache.models import load_embed_model, load_tokenizer

    s = Settings.load()
    return load_tokenizer(s), load_embed_model(s)


@pytest.fixture(scope="module")
def qa_corpus(models, tmp_path_factory):
    """The QA corpus ingested once: (root folder, corpus files, first report). Tests must not modify it."""
    root = tmp_path_factory.mktemp("qa")
    files = write_corpus(root / "corpus")
    report = make_ingestor(models, root).ingest([root / "corpus"])
    return root, files, report


def make_ingestor(models, tmp_path: Path, index: str = "idx", kv_hook=None, **ingest) -> Ingestor:
    settings = Settings.load(ingest={"index_dir": str(tmp_path / "indexes"), **ingest})
    tok, emb = models
    return Ingestor(settings, index, kv_hook=kv_hook, show_progress=False, embed_model=emb, tokenizer=tok)


def hotpot_records(n_passages: int = N_PASSAGES) -> tuple[list[dict], set[tuple[str, str]]]:
    """Whole HotpotQA records until they hold ``n_passages`` distinct passages (then trimmed)."""
    data = json.loads(shared_data(HOTPOT).read_text())
    records, seen = [], set()
    for rec in data:
        ctxs = []
        for c in rec["ctxs"]:
            if len(seen) < n_passages or (c["title"], c["text"]) in seen:
                seen.add((c["title"], c["text"]))
                ctxs.append({"title": c["title"], "text": c["text"]})
        records.append({"question": rec["question"], "ctxs": ctxs})
        if len(seen) >= n_passages:
            break
    return records, seen


LONG_TEXT = " ".join(
    f"Sentence number {i} tells how the lighthouse keeper counted {i * 7} ships that night." for i in range(24)
)


def write_corpus(root: Path) -> dict[str, Path]:
    """QA JSON (30 distinct passages, one repeated) + a .txt, a .md and an .html file."""
    records, _ = hotpot_records()
    records.append({"question": "dup", "ctxs": [records[0]["ctxs"][0]]})  # a repeated passage
    root.mkdir(parents=True, exist_ok=True)
    files = {
        "qa": root / "qa.json",
        "txt": root / "notes.txt",
        "md": root / "guide.md",
        "html": root / "sub" / "page.html",
    }
    files["html"].parent.mkdir()
    files["qa"].write_text(json.dumps(records))
    files["txt"].write_text("Penguins live in the southern hemisphere. They cannot fly but swim well.\n")
    files["md"].write_text("# Kettles\n\nA kettle boils water. Descale it every month.\n")
    files["html"].write_text(
        "<html><head><title>Volcanoes</title><style>p{}</style></head>"
        "<body><p>Volcanoes erupt molten rock called lava.</p><script>var x=1;</script></body></html>"
    )
    return files


def write_small_corpus(root: Path) -> dict[str, Path]:
    """Three short text files (one chunk each): cheap to embed, for the incremental tests."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"txt": root / "notes.txt", "md": root / "guide.md", "html": root / "sub" / "page.html"}
    files["html"].parent.mkdir()
    files["txt"].write_text("Penguins live in the southern hemisphere. They cannot fly but swim well.\n")
    files["md"].write_text("# Kettles\n\nA kettle boils water. Descale it every month.\n")
    files["html"].write_text("<html><head><title>Volcanoes</title></head><body><p>Lava is molten rock.</p></body></html>")
    return files


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF whose page shows ``text`` (Helvetica), with a correct xref table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def chunk_ids_by_doc(index: Index) -> dict[str, list[str]]:
    return {doc_id: entry.node_ids for doc_id, entry in index.manifest.docs.items()}


# --------------------------------------------------------------------------------------- tests


def test_corpus_gives_one_chunk_per_distinct_passage_and_per_short_file(models, qa_corpus):
    root, files, report = qa_corpus
    _, passages = hotpot_records()

    assert report.files_ingested == 4 and report.files_skipped == 0
    assert report.chunks_added == len(passages) + 3 == report.total_chunks  # repeated passage once
    index = Index.load(root / "indexes" / "idx", Settings.load())
    assert len(index) == report.total_chunks
    chunks = list(index.chunks())
    by_doc = {c.doc_id: c for c in chunks}
    for title, text in passages:  # doc id = hash of title + text; title kept
        c = by_doc[passage_doc_id(title, text)]
        assert (c.title, c.text, c.position) == (title, text, 0)
    html = by_doc[str(files["html"].resolve())]
    assert html.title == "Volcanoes" and "lava" in html.text and "var x" not in html.text
    tok, _ = models
    assert all(list(c.token_ids) == tok.encode(c.text) for c in chunks)  # fixed at ingest, no BOS


def test_reingest_of_unchanged_files_adds_nothing_and_says_so(models, qa_corpus):
    root, _, first = qa_corpus
    manifest = root / "indexes" / "idx" / "manifest.json"
    mtime = manifest.stat().st_mtime_ns

    again = make_ingestor(models, root).ingest([root / "corpus"])
    assert (again.chunks_added, again.chunks_removed, again.files_unchanged) == (0, 0, 4)
    assert not again.written and again.summary().startswith("nothing changed")
    assert again.total_chunks == first.total_chunks
    assert manifest.stat().st_mtime_ns == mtime  # not rewritten


def test_modified_file_replaces_exactly_its_chunks(models, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    long_file, other = corpus / "long.txt", corpus / "other.md"
    long_file.write_text(LONG_TEXT)
    other.write_text("Otters hold hands while sleeping.")
    ing = make_ingestor(models, tmp_path, chunk_size=64)
    ing.ingest([corpus])
    before = chunk_ids_by_doc(Index.load(tmp_path / "indexes" / "idx", Settings.load()))
    old_long = before[str(long_file.resolve())]
    assert len(old_long) > 3

    long_file.write_text(LONG_TEXT.replace("lighthouse keeper", "harbour master") + " A new last sentence.")
    report = ing.ingest([corpus])

    index = Index.load(tmp_path / "indexes" / "idx", Settings.load())
    after = chunk_ids_by_doc(index)
    new_long = after[str(long_file.resolve())]
    assert report.files_ingested == 1 and report.files_unchanged == 1
    assert report.chunks_removed == len(old_long) and report.chunks_added == len(new_long)
    assert after[str(other.resolve())] == before[str(other.resolve())]  # untouched
    assert not set(old_long) & set(index.docstore.docs)  # every old chunk of the file is gone
    texts = [c.text for c in index.chunks_of(str(long_file.resolve()))]
    assert "harbour master" in " ".join(texts) and "lighthouse" not in " ".join(texts)
    assert [c.position for c in index.chunks_of(str(long_file.resolve()))] == list(range(len(new_long)))
    assert len(index) == len(new_long) + 1
    assert all(c.num_tokens <= 64 for c in index.chunks())


def test_prune_removes_only_the_deleted_files_chunks(models, tmp_path):
    files = write_small_corpus(tmp_path / "corpus")
    ing = make_ingestor(models, tmp_path)
    first = ing.ingest([tmp_path / "corpus"])
    files["md"].unlink()

    kept = ing.ingest([tmp_path / "corpus"])  # without --prune the chunks stay
    assert (kept.chunks_removed, kept.total_chunks) == (0, first.total_chunks)

    pruned = ing.ingest([tmp_path / "corpus"], prune=True)
    assert (pruned.files_pruned, pruned.chunks_removed, pruned.chunks_added) == (1, 1, 0)
    assert pruned.total_chunks == first.total_chunks - 1
    index = Index.load(tmp_path / "indexes" / "idx", Settings.load())
    assert str(files["md"].resolve()) not in index.manifest.docs
    assert all("kettle" not in c.text.lower() for c in index.chunks())


def test_passage_shared_by_two_files_survives_pruning_one_of_them(models, tmp_path):
    records, _ = hotpot_records(6)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shared = records[0]["ctxs"][0]
    (corpus / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (corpus / "b.json").write_text(json.dumps([{"ctxs": [shared, {"title": "Solo", "text": "Only in b."}]}]))
    ing = make_ingestor(models, tmp_path)
    first = ing.ingest([corpus])
    assert first.total_chunks == 7  # the shared passage is indexed once

    (corpus / "b.json").unlink()
    report = ing.ingest([corpus], prune=True)
    assert (report.chunks_removed, report.total_chunks) == (1, 6)  # only "Solo" goes
    index = Index.load(tmp_path / "indexes" / "idx", Settings.load())
    assert passage_doc_id(shared["title"], shared["text"]) in index.manifest.docs


def test_kv_hook_gets_each_new_chunk_once_after_indexing(models, tmp_path):
    write_small_corpus(tmp_path / "corpus")
    calls: list[list] = []

    def hook(chunks, namespace):
        # called before the swap: the new chunks are staged, not yet published
        assert readable_path(tmp_path / "indexes" / "idx") is None and namespace == ""
        calls.append(chunks)

    report = make_ingestor(models, tmp_path, kv_hook=hook).ingest([tmp_path / "corpus"])
    assert len(calls) == 1 and len(calls[0]) == report.chunks_added
    assert {c.chunk_id for c in calls[0]} == {c.chunk_id for c in report.new_chunks}
    make_ingestor(models, tmp_path, kv_hook=hook).ingest([tmp_path / "corpus"])
    assert len(calls) == 1  # nothing new, no call


def _assert_same_index(path: Path, expected_docs: dict[str, list[str]]) -> None:
    index = Index.load(path, Settings.load())
    assert chunk_ids_by_doc(index) == expected_docs
    assert len(index) == sum(len(v) for v in expected_docs.values())
    assert not list(path.parent.glob(f".{path.name}.staging-*"))  # staging cleaned up


def test_failing_kv_hook_fails_the_ingest_and_keeps_the_previous_index(models, tmp_path):
    files = write_small_corpus(tmp_path / "corpus")
    make_ingestor(models, tmp_path).ingest([tmp_path / "corpus"])
    path = tmp_path / "indexes" / "idx"
    before = chunk_ids_by_doc(Index.load(path, Settings.load()))

    files["txt"].write_text("Completely different notes about glaciers.")
    (tmp_path / "corpus" / "new.md").write_text("A brand new file about owls.")

    def broken_hook(chunks, namespace):
        raise RuntimeError("device out of memory")

    with pytest.raises(KVPrecomputeError, match="device out of memory.*unchanged"):
        make_ingestor(models, tmp_path, kv_hook=broken_hook).ingest([tmp_path / "corpus"])
    _assert_same_index(path, before)

    retry = make_ingestor(models, tmp_path).ingest([tmp_path / "corpus"])  # the retry applies both
    assert (retry.files_ingested, retry.chunks_added, retry.chunks_removed) == (2, 2, 1)


def test_exception_mid_embedding_keeps_the_previous_index(models, tmp_path, monkeypatch):
    files = write_small_corpus(tmp_path / "corpus")
    make_ingestor(models, tmp_path).ingest([tmp_path / "corpus"])
    path = tmp_path / "indexes" / "idx"
    before = chunk_ids_by_doc(Index.load(path, Settings.load()))

    files["md"].write_text("Changed: kettles are now called boilers.")
    _, emb = models
    real_batch = type(emb).get_text_embedding_batch
    seen = {"batches": 0}

    def flaky(self, texts, **kw):  # the first batch succeeds, the second dies
        seen["batches"] += 1
        if seen["batches"] > 1:
            raise KeyboardInterrupt  # what Ctrl-C looks like mid-way
        return real_batch(self, texts, **kw)

    monkeypatch.setattr(type(emb), "get_text_embedding_batch", flaky)
    monkeypatch.setattr("ragcache.ingest.ingestor._EMBED_BATCH", 1)
    (tmp_path / "corpus" / "second.txt").write_text("Second new file, second batch.")
    with pytest.raises(KeyboardInterrupt):
        make_ingestor(models, tmp_path).ingest([tmp_path / "corpus"])
    _assert_same_index(path, before)


def test_swap_interrupted_between_renames_leaves_a_loadable_index(models, tmp_path):
    write_small_corpus(tmp_path / "corpus")
    ing = make_ingestor(models, tmp_path)
    first = ing.ingest([tmp_path / "corpus"])
    path = tmp_path / "indexes" / "idx"
    os.rename(path, previous_path(path))  # the state after the swap's first rename

    assert len(Index.load(path, Settings.load())) == first.total_chunks  # readers fall back
    again = ing.ingest([tmp_path / "corpus"])  # the next ingest restores it and finds no change
    assert path.is_dir() and not previous_path(path).exists()
    assert (again.chunks_added, again.files_unchanged) == (0, 3)


def test_each_kind_of_bad_input_is_skipped_with_its_reason(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (bad / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (bad / "empty.md").write_bytes(b"")
    (bad / "blank.txt").write_text("   \n\t\n")
    (bad / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage")
    (bad / "notpdf.pdf").write_bytes(b"hello, I am not a PDF")
    (bad / "big.txt").write_text("word " * 400)  # 2,000 bytes > max_file_mb = 0.001 (1,000 bytes)
    (bad / "image.png").write_bytes(b"\x89PNG")
    (bad / "broken.json").write_text('{"ctxs": [')
    (bad / "good.txt").write_text("The only good file here.")
    (bad / "good.pdf").write_bytes(minimal_pdf("Penguins are flightless birds."))

    report = make_ingestor(models, tmp_path, max_file_mb=0.001).ingest([bad, tmp_path / "missing.txt"])

    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    expected = {
        "binary.txt": "binary file",
        "latin1.txt": "undecodable text: not UTF-8 (byte 0xe9",
        "empty.md": "empty file (0 bytes)",
        "blank.txt": "empty file (no text)",
        "broken.pdf": "unreadable PDF",
        "notpdf.pdf": "unreadable PDF: no %PDF- header",
        "big.txt": "larger than ingest.max_file_mb",
        "image.png": "unsupported file type '.png'",
        "broken.json": "invalid JSON",
        "missing.txt": "does not exist",
    }
    assert set(reasons) == set(expected)
    for name, reason in expected.items():
        assert reason in reasons[name], (name, reasons[name])
    assert report.files_skipped == len(expected) and report.files_ingested == 2
    assert f"{len(expected)} skipped" in report.summary()
    index = Index.load(tmp_path / "indexes" / "idx", Settings.load())
    pdf = index.chunks_of(str((bad / "good.pdf").resolve()))
    assert len(pdf) == 1 and "flightless" in pdf[0].text


def test_only_bad_inputs_write_no_index(models, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    report = make_ingestor(models, tmp_path).ingest([tmp_path / "empty.txt"])
    assert report.total_chunks == 0 and not report.written and report.files_skipped == 1
    assert not (tmp_path / "indexes" / "idx").exists()


def test_chunks_never_exceed_chunk_size_tokens(models, tmp_path):
    from llama_index.core.schema import Document

    tok, _ = models
    texts = {
        "prose": LONG_TEXT,
        "nopunct": " ".join(["unpunctuated"] * 120) + " " + "x" * 300,
        "mixed": "Ünïcödé — 日本語のテキスト。" * 20 + "\n\n```\n" + "a=b+c;" * 100 + "\n```",
    }
    chunk_size = 32
    ing = make_ingestor(models, tmp_path, chunk_size=chunk_size, chunk_overlap=8)
    for name, text in texts.items():
        chunks = ing.chunk_document(Document(id_=name, text=text), title=name)
        assert len(chunks) > 3
        assert [c.position for c in chunks] == list(range(len(chunks)))
        for c in chunks:
            assert 0 < c.num_tokens <= chunk_size, (c.num_tokens, c.text)
            assert list(c.token_ids) == tok.encode(c.text)
        assert "".join(c.text for c in chunks).replace(" ", "").count("lighthouse") >= (name == "prose") * 24


def test_other_chunk_settings_than_the_index_was_built_with_are_refused(models, tmp_path):
    write_small_corpus(tmp_path / "corpus")
    make_ingestor(models, tmp_path).ingest([tmp_path / "corpus"])
    with pytest.raises(IndexMismatchError, match="chunk_size 512 -> 256"):
        make_ingestor(models, tmp_path, chunk_size=256).ingest([tmp_path / "corpus"])
    with pytest.raises(ConfigError, match="chunk_overlap"):
        make_ingestor(models, tmp_path, chunk_size=64, chunk_overlap=64)


def test_cli_ingest_prints_summary_and_exits_nonzero_only_when_nothing_was_ingested(models, tmp_path, capsys):
    from app.cli import main

    write_small_corpus(tmp_path / "corpus")
    (tmp_path / "corpus" / "empty.txt").write_text("")
    index = str(tmp_path / "cli-index")

    # the KV precompute through the engine (eager) and the lazy path's first question are covered by
    # tests/test_pipeline.py; --kv lazy starts no engine
    assert main(["ingest", str(tmp_path / "corpus"), "--index", index, "--quiet", "--kv", "lazy"]) == 0
    out, err = capsys.readouterr()
    assert "3 files ingested, 0 unchanged, 1 skipped" in out
    assert "KV lazy: nothing computed now" in out and "empty.txt: empty file" in err
    assert "starting the engine" not in err

    assert main(["ingest", str(tmp_path / "corpus"), "--index", index, "--quiet", "--no-kv"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("nothing changed") and "KV precompute" not in err

    assert main(["ingest", str(tmp_path / "corpus" / "empty.txt"), "--index", str(tmp_path / "x"), "--quiet"]) == 2
    _, err = capsys.readouterr()
    assert "nothing could be ingested" in err
    # the same into the existing index: still an error, though the index is there (and unchanged)
    assert main(["ingest", str(tmp_path / "corpus" / "empty.txt"), "--index", index, "--quiet"]) == 2
    _, err = capsys.readouterr()
    assert "nothing could be ingested" in err

    # a name without a separator resolves under ingest.index_dir (here ./indexes in tmp_path); --no-kv,
    # the older flag, is --kv lazy
    assert main(["ingest", str(tmp_path / "corpus" / "notes.txt"), "--index", "named", "--quiet", "--no-kv"]) == 0
    assert (tmp_path / "indexes" / "named" / "manifest.json").is_file()
    assert "KV lazy: nothing computed now" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # both flags at once: argparse refuses
        main(["ingest", str(tmp_path / "corpus"), "--index", "named", "--kv", "eager", "--no-kv"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_bare_index_name_never_means_a_folder_of_the_working_directory(tmp_path, monkeypatch):
    from ragcache.index.folder import resolve_index_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    assert resolve_index_path("docs", "indexes") == Path("indexes") / "docs"
    assert resolve_index_path("./docs", "indexes") == Path("./docs")
    assert resolve_index_path(str(tmp_path / "idx"), "indexes") == tmp_path / "idx"


@pytest.mark.parametrize("existing", [False, True], ids=["new index", "existing index"])
def test_an_ingest_whose_every_path_is_missing_fails_before_loading_any_model(tmp_path, capsys, existing):
    import subprocess
    import sys

    from app.cli import main

    index = tmp_path / "idx"
    if existing:  # an index folder as an earlier ingest leaves it (its contents are not read)
        index.mkdir()
        (index / "manifest.json").write_text("{}")
    missing = tmp_path / "no" / "such" / "path"
    code = main(["ingest", str(missing), "--index", str(index), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"ragcache: error: no such file or folder: {missing}; check the path "
                                 "(nothing was ingested)"]
    # in a fresh process: refused before any model (transformers) or llama-index is imported
    probe = ("import sys; from app.cli import main; code = main(sys.argv[1:]); "
             "print(code, 'transformers' in sys.modules, 'llama_index.core' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, "ingest", str(missing), "--index", str(index)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.stdout.split() == ["2", "False", "False"], r.stderr[-2000:]


@pytest.mark.parametrize("target, words", [
    ("file", "is a file, not an index folder"),
    ("folder", "a folder with other files (no manifest.json), not an index"),
])
def test_an_ingest_never_replaces_a_file_or_a_folder_that_is_not_an_index(tmp_path, capsys, target, words):
    from app.cli import main

    (tmp_path / "notes.txt").write_text("Penguins swim.")
    victim = tmp_path / "mine"
    if target == "file":
        victim.write_text("precious")
    else:
        victim.mkdir()
        (victim / "thesis.tex").write_text("precious")
    assert main(["ingest", str(tmp_path / "notes.txt"), "--index", str(victim), "--quiet", "--no-kv"]) == 2
    assert words in capsys.readouterr().err
    assert (victim.read_text() if target == "file" else (victim / "thesis.tex").read_text()) == "precious"


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden"])
def test_index_names_that_would_name_the_index_home_or_its_parent_are_refused(tmp_path, capsys, name):
    from app.cli import main

    (tmp_path / "notes.txt").write_text("Penguins swim.")
    assert main(["ingest", str(tmp_path / "notes.txt"), "--index", name, "--quiet", "--no-kv"]) == 2
    assert "is not an index name" in capsys.readouterr().err
    assert main(["ask", "why?", "--index", name]) == 2


def test_the_index_namespace_is_recorded_at_the_first_ingest_and_kept(models, tmp_path):
    from ragcache.index.faiss_index import read_chunks

    write_small_corpus(tmp_path / "corpus")
    seen: list[str] = []
    tok, emb = models
    settings = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")})
    first = Ingestor(settings, "idx", kv_hook=lambda chunks, ns: seen.append(ns), show_progress=False,
                     embed_model=emb, tokenizer=tok, namespace="tenant-a")
    report = first.ingest([tmp_path / "corpus"])
    assert report.namespace == "tenant-a" and seen == ["tenant-a"]
    manifest, chunks = read_chunks(tmp_path / "indexes" / "idx")
    assert manifest.namespace == "tenant-a" and len(chunks) == report.total_chunks
    (tmp_path / "corpus" / "more.txt").write_text("Owls hunt at night.")
    again = Ingestor(settings, "idx", kv_hook=lambda chunks, ns: seen.append(ns), show_progress=False,
                     embed_model=emb, tokenizer=tok)  # no namespace given: the recorded one is kept
    assert again.ingest([tmp_path / "corpus"]).chunks_added == 1 and seen[-1] == "tenant-a"
    other = Ingestor(settings, "idx", show_progress=False, embed_model=emb, tokenizer=tok, namespace="tenant-b")
    with pytest.raises(IndexMismatchError, match="namespace 'tenant-a', not 'tenant-b'"):
        other.ingest([tmp_path / "corpus"])
    with pytest.raises(ConfigError, match="--namespace 'bad name'"):
        Ingestor(settings, "idx", namespace="bad name")


def test_a_bad_jsonl_line_is_skipped_and_named_by_its_line_and_the_other_records_are_kept(tmp_path):
    """Through `ragcache ingest` (the real CLI): one broken line costs that line, not the file."""
    import subprocess
    import sys

    from tests.conftest import REPO

    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join([
        json.dumps({"ctxs": [{"title": "Velmora", "text": "Velmora was founded in 1432 by Idris Kell."}]}),
        '{"ctxs": [{"title": "Broken", "text": "cut off',
        "",
        json.dumps({"text": "The Amber Hall has 212 seats and a copper roof."}),
    ]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(RAGCACHE_INGEST__INDEX_DIR=str(tmp_path / "indexes"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(qa), "--index", "qa", "--no-kv", "--quiet"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"skipped {qa} line 2: invalid JSON (Unterminated string starting at: column 39)" in r.stderr, r.stderr
    assert "the rest of the file is kept" in r.stderr and "line 1 column" not in r.stderr
    assert "1 files ingested" in r.stdout and "0 skipped" in r.stdout and "2 chunks added" in r.stdout, r.stdout
    texts = sorted(c.text for c in Index.load(tmp_path / "indexes" / "qa", Settings.load()).chunks())
    assert texts == ["The Amber Hall has 212 seats and a copper roof.", "Velmora was founded in 1432 by Idris Kell."]


def test_an_undecodable_jsonl_line_and_json_lines_that_are_no_records_are_named_and_the_rest_is_kept(tmp_path):
    """Through `ragcache ingest`: a line of invalid UTF-8 costs that line, not the file (the file is
    decoded line by line), and lines that are JSON but not records are named as well."""
    import subprocess
    import sys

    from tests.conftest import REPO

    qa = tmp_path / "qa.jsonl"
    qa.write_bytes(b"\n".join([
        json.dumps({"ctxs": [{"title": "Velmora", "text": "Velmora was founded in 1432 by Idris Kell."}]}).encode(),
        b'\xff\xfe{"a":1}',
        json.dumps({"text": "The Amber Hall has 212 seats and a copper roof."}).encode(),
        b"42",
        b'{"ctxs": "notalist"}',
        b'{"title": "no text here"}',
    ]) + b"\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(RAGCACHE_INGEST__INDEX_DIR=str(tmp_path / "indexes"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(qa), "--index", "qa", "--no-kv", "--quiet"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    named = [line for line in r.stderr.splitlines() if line.startswith(f"skipped {qa} ")]
    assert named == [
        f"skipped {qa} line 2: not UTF-8 (byte 0xff at column 1); the rest of the file is kept",
        f"skipped {qa} line 4: a number, not a record (expected an object with ctxs: [{{title, text}}] or a text "
        "string); the rest of the file is kept",
        f"skipped {qa} line 5: ctxs is a string, not a list of {{title, text}} passages; the rest of the file is kept",
        f"skipped {qa} line 6: an object without ctxs or text (expected an object with ctxs: [{{title, text}}] or a "
        "text string); the rest of the file is kept",
    ], r.stderr
    assert "1 files ingested" in r.stdout and "0 skipped" in r.stdout and "2 chunks added" in r.stdout, r.stdout
    texts = sorted(c.text for c in Index.load(tmp_path / "indexes" / "qa", Settings.load()).chunks())
    assert texts == ["The Amber Hall has 212 seats and a copper roof.", "Velmora was founded in 1432 by Idris Kell."]


@pytest.mark.parametrize("name, content, what", [
    ("empty.json", "[]", "an empty list"),
    ("empty-object.json", "{}", "an empty object"),
    ("nested.json", '[{}, {"ctxs": []}, null]', "a list of empty values only"),
    ("empty.jsonl", "[]\n\n{}\n", "every line holds empty JSON"),
])
def test_an_empty_json_file_is_nothing_to_ingest_not_a_document(models, tmp_path, capsys, name, content, what):
    from app.cli import main

    (tmp_path / name).write_text(content)
    report = make_ingestor(models, tmp_path).ingest([tmp_path / name])
    [skipped] = report.skipped
    assert skipped.reason.startswith("nothing to ingest: ") and what in skipped.reason
    assert "no records, no text" in skipped.reason
    assert report.total_chunks == 0 and not report.written and not (tmp_path / "indexes" / "idx").exists()
    # beside a real document it costs nothing: only the document is indexed
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / name).write_text(content)
    (tmp_path / "docs" / "velmora.txt").write_text("Velmora was founded in 1432 by Idris Kell.")
    assert main(["ingest", str(tmp_path / "docs"), "--index", str(tmp_path / "cli"), "--quiet", "--no-kv"]) == 0
    out, err = capsys.readouterr()
    assert f"skipped {tmp_path / 'docs' / name}: nothing to ingest" in err and "1 files ingested" in out
    texts = [c.text for c in Index.load(tmp_path / "cli", Settings.load()).chunks()]
    assert texts == ["Velmora was founded in 1432 by Idris Kell."]
