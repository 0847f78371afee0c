"""`ragcache serve` run as the real command (``python -m app.cli serve``) on a loopback port: what an
operator sees when reuse/blend is unavailable at start (refused with one line, or served in the
fallback mode /health names), keys scoped to indexes (401/403, tenants in /metrics, a keys file
replaced with the same mtime), the request head and body size limits (431, 413), a client gone
before its answer, no KV mixing between 16 concurrent blend streams in float32, and `kill -9` of the
server taking its vLLM engine processes with it (and a restart that works).

Two models: a tiny random Gemma (no ragcache adapter: reuse/blend are unavailable; starts fast)
and SmolLM2 in float32 (one server for the keys, limits and concurrency tests).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from tiny_models import build_tiny

from tests.conftest import REPO, ZORBIA_DOCS

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 600  # an engine start on 2 busy cores


# ---- processes ----------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None when the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children...)."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None and fields[0] != "Z":
            by_parent.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def wait_gone(pids: list[int], timeout_s: float = 30) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to die."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# ---- a served `ragcache serve` -------------------------------------------------------------------


def cli_env(settings_file: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(RAGCACHE_SETTINGS_FILE=str(settings_file), PYTHONPATH=str(REPO), **extra)
    return env


def run_cli(root: Path, env: dict[str, str], *argv: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


class Server:
    """``python -m app.cli serve --port PORT`` in ``root``; its log in ``root/serve-N.log``."""

    count = 0

    def __init__(self, root: Path, env: dict[str, str], port: int, *argv: str):
        Server.count += 1
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / f"serve-{Server.count}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), *argv],
                                         cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}"
            try:
                return httpx.get(f"{self.url}/health", timeout=5).json()
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"serve did not start in {START_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def write_settings(root: Path, model: str, index: str, dtype: str, **engine: object) -> Path:
    engine_lines = "".join(f"{k} = {v!r}\n" for k, v in engine.items())
    path = root / "settings.toml"
    path.write_text(f"""[models]
model = "{model}"

[engine]
dtype = "{dtype}"
{engine_lines}
[store]
ssd_cache_dir = "{root / 'kv'}"
cpu_kv_pool_gb = 0.5
remote_url = ""

[ingest]
index_dir = "{root / 'idx'}"

[serve]
index = "{index}"
""")
    return path


def ingest(settings_file: Path, index: str, docs: Path, namespace: str = "") -> None:
    """An index over ``docs`` without KV (set-up, through the SDK)."""
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import Ingestor

    settings = Settings.load(settings_file)
    report = Ingestor(settings, index, show_progress=False, namespace=namespace or None).ingest([docs])
    assert report.chunks_added == len(ZORBIA_DOCS)


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name, text in ZORBIA_DOCS.items():
        (folder / name).write_text(text)
    return folder


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- reuse/blend unavailable at start ------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, docs):
    """A root folder with settings for the tiny Gemma (no adapter) and its index ``gem``."""
    root = tmp_path_factory.mktemp("gemma")
    tiny = build_tiny("gemma", root / "model")
    settings = write_settings(root, str(tiny.folder), "gem", "float32", max_model_len=1024,
                              kv_cache_memory_bytes=32 << 20, max_tokens=8)
    ingest(settings, "gem", docs)
    return root, settings


def test_serve_refuses_to_start_in_blend_when_blend_is_unavailable_with_one_named_line(gemma):
    from ragcache_testing.services import free_port

    root, settings = gemma
    port = free_port()
    blend = cli_env(settings, RAGCACHE_ENGINE__MODE="blend")  # auto (the default) would route to full prefill
    r = run_cli(root, blend, "serve", "--port", str(port))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("ragcache: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "will not start in blend mode" in errors[0] and "GemmaForCausalLM" in errors[0]
    assert "serve.blend_fallback" in errors[0]
    # `ask` in blend mode on the same model: the same kind of one line, exit 2
    a = run_cli(root, blend, "ask", "What is the capital of Zorbia?", "--index", "gem")
    assert a.returncode == 2 and "Traceback" not in a.stderr, a.stderr[-3000:]
    assert a.stderr.strip().splitlines()[-1].startswith("ragcache: error: reuse/blend and KV precompute are disabled")
    # options the run would drop: one line and exit 2 from the real command, before the engine starts
    for argv, env, words in (
            (["--budget", "fixed", "--mass-left", "0.01"], {}, "--mass-left 0.01: sets the adaptive budget's threshold"),
            (["--selection", "deviation", "--budget", "adaptive"], {}, "--budget adaptive: the adaptive budget"),
            (["--recompute-ratio", "0.2"], {"RAGCACHE_ENGINE__MODE": "full"},
             "--recompute-ratio 0.2: applies in blend or auto mode only, and the request's mode is 'full' (no mode "
             "given: the setting engine.mode)")):
        a = run_cli(root, cli_env(settings, **env), "ask", "What is kelmet?", "--index", "gem", *argv, timeout_s=120)
        errors = [line for line in a.stderr.splitlines() if line.startswith("ragcache: error:")]
        assert a.returncode == 2 and len(errors) == 1 and "Traceback" not in a.stderr, a.stderr[-3000:]
        assert errors[0].startswith(f"ragcache: error: {words}"), errors


def test_fallback_mode_is_served_and_named_and_kill_9_leaves_no_engine_process_behind(gemma):
    from ragcache_testing.services import free_port

    root, settings = gemma
    env = cli_env(settings, RAGCACHE_SERVE__BLEND_FALLBACK="full", RAGCACHE_ENGINE__MODE="blend")
    port = free_port()
    server = Server(root, env, port)
    try:
        health = server.wait_ready()
        assert health["mode"] == "full" and health["blend"]["available"] is False
        assert "GemmaForCausalLM" in health["blend"]["reason"]
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="gem", messages=user("What is kelmet?"), max_tokens=4)
        assert r.model_extra["ragcache"]["metrics"]["mode"] == "full"
        with pytest.raises(openai.BadRequestError, match="no DecoderOps adapter") as e:
            c.chat.completions.create(model="gem", messages=user("What is kelmet?"), max_tokens=4,
                                      extra_body={"ragcache": {"mode": "blend"}})
        assert e.value.body["param"] == "ragcache.mode" and e.value.body["code"] == "mode_unavailable"
        # a blend-only option without a mode: the fallback's full mode never blends, so it is named, not dropped
        with pytest.raises(openai.BadRequestError, match=r"ragcache\.recompute_ratio 0\.3: applies in blend or auto "
                           r"mode only, and the request's mode is 'full' \(no mode given: serve\.blend_fallback = "
                           r"'full', as blend mode \(engine\.mode\) is unavailable on this server\): drop it$") as e:
            c.chat.completions.create(model="gem", messages=user("What is kelmet?"), max_tokens=4,
                                      extra_body={"ragcache": {"recompute_ratio": 0.3}})
        assert e.value.body["param"] == "ragcache.recompute_ratio" and e.value.body["code"] == "option_not_applicable"

        engine = descendants(server.proc.pid)
        assert any("EngineCore" in title(p) for p in engine), [title(p) for p in engine]
        server.proc.kill()  # kill -9: the server cannot shut its engine down
        server.proc.wait(30)
        assert wait_gone(engine) == [], [title(p) for p in engine if alive(p)]
    finally:
        server.stop()

    again = Server(root, env, port)  # the same port and KV folder right away: nothing left to race
    try:
        assert again.wait_ready()["mode"] == "full"
        engine = descendants(again.proc.pid)
        assert engine
    finally:
        assert again.stop() in (0, 130)
    assert wait_gone(engine) == []


# ---- keys, headers, concurrency (SmolLM2, float32) -----------------------------------------------


KEYS = {"acme-key-1": "acme", "ops-key-9": "ops", "ns-key-3": "nsacme"}


@pytest.fixture(scope="module")
def smol(tmp_path_factory, docs):
    """A float32 SmolLM2 server with indexes ``acme`` (own namespace acme) and ``beta``, a shared key
    and a keys file: acme reads index acme, ops every index, nsacme the indexes of namespace acme."""
    from ragcache.server.keys import key_digest
    from ragcache_testing.services import free_port

    root = tmp_path_factory.mktemp("smol")
    # blend by default: these tests check blended answers (auto would send the ~40-token passages to full prefill)
    settings = write_settings(root, "smollm2-135m-instruct", "acme", "float32", max_model_len=4096,
                              kv_cache_memory_bytes=1 << 30, max_tokens=12, mode="blend")
    ingest(settings, "acme", docs, namespace="acme")
    ingest(settings, "beta", docs)
    keys = root / "keys.toml"
    keys.write_text(f"""
[[key]]
tenant = "acme"
sha256 = "{key_digest('acme-key-1')}"
indexes = ["acme"]

[[key]]
tenant = "ops"
sha256 = "{key_digest('ops-key-9')}"
indexes = ["*"]

[[key]]
tenant = "nsacme"
sha256 = "{key_digest('ns-key-3')}"
namespaces = ["acme"]
""")
    env = cli_env(settings, RAGCACHE_SERVE__API_KEY="shared-key")
    server = Server(root, env, free_port(), "--keys-file", str(keys))
    try:
        health = server.wait_ready()
        assert health["mode"] == "blend" and health["dtype"] == "float32" and health["blend"]["available"]
        yield server
    finally:
        server.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def scrape(server: Server, key: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_a_scoped_key_reads_only_its_indexes_and_metrics_name_the_tenant(smol):
    acme = client(smol, "acme-key-1")
    assert [m.id for m in acme.models.list().data] == ["acme"]
    assert sorted(m.id for m in client(smol, "ops-key-9").models.list().data) == ["acme", "beta"]
    assert sorted(m.id for m in client(smol, "shared-key").models.list().data) == ["acme", "beta"]
    assert [m.id for m in client(smol, "ns-key-3").models.list().data] == ["acme"]

    answer = acme.chat.completions.create(model="acme", messages=user("What is kelmet?"), max_tokens=4)
    assert answer.model_extra["ragcache"]["index"] == "acme"
    with pytest.raises(openai.PermissionDeniedError, match="tenant 'acme' may not read") as e:
        acme.chat.completions.create(model="acme", messages=user("What is kelmet?"), max_tokens=4,
                                     extra_body={"ragcache": {"index": "beta"}})
    assert e.value.body["param"] == "ragcache.index" and e.value.body["code"] == "index_not_allowed"
    with pytest.raises(openai.PermissionDeniedError) as e:
        acme.chat.completions.create(model="beta", messages=user("What is kelmet?"), max_tokens=4)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.PermissionDeniedError):  # an index that does not exist: no existence oracle
        acme.chat.completions.create(model="gamma", messages=user("What is kelmet?"), max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        client(smol, "ns-key-3").chat.completions.create(model="beta", messages=user("hi"), max_tokens=2)
    client(smol, "ns-key-3").chat.completions.create(model="acme", messages=user("hi"), max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(smol, "wrong-key").models.list()
    assert httpx.get(f"{smol.url}/metrics", headers={"Authorization": "Bearer acme-key-1"}).status_code == 403
    assert httpx.get(f"{smol.url}/v1/cache", headers={"Authorization": "Bearer acme-key-1"}).status_code == 403
    assert httpx.get(f"{smol.url}/metrics").status_code == 401

    client(smol, "ops-key-9").chat.completions.create(model="beta", messages=user("What is kelmet?"), max_tokens=4)
    metrics = scrape(smol, "ops-key-9")

    def requests(**labels: str) -> float:
        return sum(v for (n, ls), v in metrics.items()
                   if n == "ragcache_requests_total" and set(labels.items()) <= set(ls))

    assert requests(tenant="acme", index="acme", outcome="completed") == 1
    assert requests(tenant="nsacme", index="acme", outcome="completed") == 1
    assert requests(tenant="ops", index="beta", outcome="completed") == 1
    assert requests(tenant="acme", index="beta") == 0  # refused before any work: not a request of beta


def raw_request(server: Server, parts: list[bytes], pause_s: float = 0.0) -> tuple[int, bytes]:
    """Send ``parts`` over one raw socket (``pause_s`` between writes), then read to the end:
    (status code, body)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(pause_s)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(1 << 16):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_a_request_line_and_headers_over_max_header_bytes_get_431_however_they_arrive(smol):
    """serve.max_header_bytes (64 KiB) holds for the whole head, in one write or in many (h11's own
    bound only sees a head that is still incomplete in its buffer)."""
    def get(target: bytes, headers: bytes) -> bytes:
        return b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers + b"\r\n"

    pad = get(b"/health", b"X-Pad: " + b"a" * 70_000 + b"\r\n")
    cases = {
        "a 70 KB header in one write": [pad],
        "a 70 KB header in 10 writes": [pad[i:i + 7_000] for i in range(0, len(pad), 7_000)],
        "a 70 KB URL": [get(b"/health?q=" + b"a" * 70_000, b"")],
        "1000 headers of 100 bytes": [get(b"/health", b"".join(b"X-H%04d: %s\r\n" % (i, b"b" * 90) for i in range(1000)))],
        "a 1 MB header": [get(b"/health", b"X-Pad: " + b"a" * (1 << 20) + b"\r\n")],
    }
    for case, parts in cases.items():
        status, body = raw_request(smol, parts, pause_s=0.05 if len(parts) > 1 else 0.0)
        assert status == 431, (case, status, body[:300])
        err = json.loads(body)["error"]
        assert err["code"] == "request_header_fields_too_large" and "serve.max_header_bytes = 65536" in err["message"]
    status, body = raw_request(smol, [get(b"/health", b"X-Pad: " + b"a" * 60_000 + b"\r\n")])  # under the limit
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_a_60_mb_body_gets_413_before_it_is_parsed_and_the_server_stays_small(smol):
    """serve.max_body_bytes (8 MiB): a body over it is refused by its Content-Length, or, sent
    chunked, as it arrives; the server's memory does not grow by the body and nothing is left in
    flight."""
    def rss_mb() -> float:
        status = Path(f"/proc/{smol.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024

    body = json.dumps({"model": "acme", "max_tokens": 4, "messages": user("why? " * (12 << 20))}).encode()
    assert len(body) > 60e6
    headers = {"Authorization": "Bearer shared-key", "Content-Type": "application/json"}
    before = rss_mb()
    sized = httpx.post(f"{smol.url}/v1/chat/completions", content=body, headers=headers, timeout=120)

    def pieces():
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    chunked = httpx.post(f"{smol.url}/v1/chat/completions", content=pieces(), headers=headers, timeout=120)
    grown = rss_mb() - before
    for r, seen in ((sized, f"Content-Length {len(body)}"), (chunked, "more than 8388608 bytes arrived")):
        assert r.status_code == 413, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "serve.max_body_bytes = 8388608" in err["message"]
        assert seen in err["message"]
    assert grown < 100, f"the server grew by {grown:.0f} MB"  # unbounded, it grew by gigabytes
    health = httpx.get(f"{smol.url}/health").json()
    assert health["in_flight"] == 0 and health["engine_unfinished_requests"] == 0
    ok = client(smol, "shared-key").chat.completions.create(model="acme", messages=user("What is kelmet?"), max_tokens=2)
    assert ok.choices[0].message.content  # the server is unharmed


def test_a_client_that_leaves_before_its_answer_has_its_engine_request_aborted(smol):
    def aborted() -> float:
        return sum(v for (n, ls), v in scrape(smol, "ops-key-9").items()
                   if n == "ragcache_requests_total" and ("outcome", "aborted") in ls and ("tenant", "default") in ls)

    before = aborted()
    # a minute or more of decoding unless aborted; in full mode (no chunk KV looked up: an aborted
    # request's lookups reach the store's counters but not /metrics, which the last test compares)
    body = json.dumps({"model": "acme", "messages": user("Tell me everything about Zorbia."), "max_tokens": 3000,
                       "ignore_eos": True, "ragcache": {"mode": "full"}}).encode()
    port = int(smol.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer shared-key\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        while httpx.get(f"{smol.url}/health").json()["engine_unfinished_requests"] == 0:  # until vLLM has it
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.2)
    deadline = time.monotonic() + 30  # the client is gone: vLLM's request must go within moments
    while (h := httpx.get(f"{smol.url}/health").json())["engine_unfinished_requests"] or h["in_flight"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    assert aborted() - before == 1


def test_a_keys_file_replaced_with_the_same_mtime_takes_on_the_next_request(smol):
    """Keys are added and revoked by the file's content, whatever its mtime (rsync -t, cp -p and
    images with fixed mtimes keep it): replaced atomically, or rewritten in place at the same size."""
    from ragcache.server.keys import key_digest

    keys = smol.log.parent / "keys.toml"
    original = keys.read_text()
    mtime = keys.stat().st_mtime_ns
    entry = f'\n[[key]]\ntenant = "temp"\nsha256 = "{key_digest("temp-key-7")}"\nindexes = ["beta"]\n'

    def replace(text: str) -> None:  # as `touch -d @T keys.new && mv keys.new keys.toml`
        new = keys.with_name("keys.new")
        new.write_text(text)
        os.utime(new, ns=(mtime, mtime))
        os.replace(new, keys)
        assert keys.stat().st_mtime_ns == mtime

    def models(key: str) -> list[str]:
        return [m.id for m in client(smol, key).models.list().data]

    try:
        with pytest.raises(openai.AuthenticationError):
            models("temp-key-7")
        replace(original + entry)
        assert models("temp-key-7") == ["beta"]  # added
        replace(original)
        with pytest.raises(openai.AuthenticationError):
            models("temp-key-7")  # revoked
        replace(original + entry)
        assert models("temp-key-7") == ["beta"]
        with open(keys, "r+") as f:  # in place, same size, same mtime: another key's digest
            f.write(original + entry.replace(key_digest("temp-key-7"), key_digest("temp-key-8")))
        os.utime(keys, ns=(mtime, mtime))
        with pytest.raises(openai.AuthenticationError):
            models("temp-key-7")
        assert models("temp-key-8") == ["beta"]
    finally:
        replace(original)
    assert models("acme-key-1") == ["acme"]


def test_a_keys_file_emptied_deleted_or_broken_refuses_the_removed_key_on_the_next_request(smol):
    """Revocation fails closed, within one request, and /health and /metrics say so: emptied -> 401
    for every scoped key (the shared key still works); deleted -> 503 naming the file for every key;
    a key removed and the TOML broken in the same write -> 503 (serve.keys_invalid = "refuse")."""
    keys = smol.log.parent / "keys.toml"
    original = keys.read_text()

    def status(key: str) -> int:
        return httpx.get(f"{smol.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    def keys_health() -> dict:
        return httpx.get(f"{smol.url}/health", timeout=30).json()["keys_file"]

    before = keys_health()
    assert before == {"state": "ok", "since": before["since"]} and before["since"] <= time.time()
    try:
        keys.write_text("")
        assert status("acme-key-1") == 401 and status("ops-key-9") == 401 and status("shared-key") == 200
        assert keys_health()["state"] == "empty"
        metrics = scrape(smol, "shared-key")
        assert metrics[("ragcache_keys_file_state", (("state", "empty"),))] == 1
        assert metrics[("ragcache_keys_file_state", (("state", "ok"),))] == 0
        assert metrics[("ragcache_keys_file_state_since_seconds", ())] == keys_health()["since"]

        keys.unlink()
        r = httpx.get(f"{smol.url}/v1/models", headers={"Authorization": "Bearer acme-key-1"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "keys_unavailable"
        assert f"serve.keys_file {str(keys)!r} does not exist" in r.json()["error"]["message"]
        assert status("shared-key") == 503 and keys_health()["state"] == "missing"

        keys.write_text(original)
        assert status("acme-key-1") == 200 and keys_health()["state"] == "ok"
        broken = original.replace('tenant = "acme"', 'tenant = "acme\n', 1)  # acme removed, the TOML broken
        keys.write_text(broken)
        r = httpx.get(f"{smol.url}/v1/models", headers={"Authorization": "Bearer acme-key-1"}, timeout=30)
        assert r.status_code == 503 and "is not valid TOML" in r.json()["error"]["message"]
        assert str(keys) in r.json()["error"]["message"] and status("ops-key-9") == 503
        invalid = keys_health()
        assert invalid["state"] == "invalid" and invalid["since"] >= before["since"]
    finally:
        keys.write_text(original)
    assert status("acme-key-1") == 200 and keys_health()["state"] == "ok"


def test_options_the_server_would_drop_are_400s_naming_them_and_numbers_are_strict(smol):
    """Over the real server: contradictory options, a blend-only option with a mode that never
    blends, and a boolean or a string where a number goes, each a 400 naming the field."""
    c = client(smol, "shared-key")
    cases = [({"budget": "fixed", "mass_left": 0.01}, "ragcache.mass_left", "budget is 'fixed'"),
             ({"selection": "deviation", "mass_left": 0.01}, "ragcache.mass_left", "selection 'deviation' does not"),
             ({"selection": "deviation", "budget": "adaptive"}, "ragcache.budget", "selection 'deviation' does not"),
             ({"mode": "full", "recompute_ratio": 0.2}, "ragcache.recompute_ratio", "the request's mode is 'full'"),
             ({"recompute_ratio": True}, "ragcache.recompute_ratio", "valid number (got True)"),
             ({"recompute_ratio": "0.1"}, "ragcache.recompute_ratio", "valid number (got '0.1')"),
             ({"top_k": True}, "ragcache.top_k", "valid integer (got True)"),
             ({"top_k": "3"}, "ragcache.top_k", "valid integer (got '3')")]
    for options, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="acme", messages=user("What is kelmet?"), max_tokens=2,
                                      extra_body={"ragcache": options})
        assert e.value.body["param"] == param and words in e.value.body["message"], (options, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="acme", messages=user("What is kelmet?"), max_tokens="3")
    assert e.value.body["param"] == "max_tokens"
    assert httpx.get(f"{smol.url}/health").json()["engine_unfinished_requests"] == 0  # nothing reached vLLM


def test_a_scoped_key_gets_one_answer_for_every_name_that_is_no_served_index(smol, docs, tmp_path):
    """A path outside ingest.index_dir is refused before anything is read there: an index of the
    key's own namespace at that path and a path where nothing exists get the same 403 (the shared
    key: the same 404), so a key cannot probe the server's disk."""
    elsewhere = tmp_path / "elsewhere"
    ingest(smol.log.parent / "settings.toml", str(elsewhere), docs, namespace="acme")
    nothing = tmp_path / "nothing"
    for key, status in (("ns-key-3", 403), ("acme-key-1", 403), ("shared-key", 404)):
        answers = []
        for path in (elsewhere, nothing):
            r = httpx.post(f"{smol.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json={"model": "acme", "messages": user("hi"), "max_tokens": 2,
                                 "ragcache": {"index": str(path)}})
            answers.append((r.status_code, r.json()["error"]["message"].replace(str(path), "PATH")))
        assert answers[0] == answers[1] and answers[0][0] == status, (key, answers)


QUESTIONS = ["What is the capital of Zorbia?", "Who founded Velmora?", "What is kelmet?",
             "How many seats has the Amber Hall?", "When was Velmora founded?", "Where does parliament meet?",
             "What river flows through Velmora?", "How often are elections held in Zorbia?",
             "What is Velmora known for?", "What roof does the Amber Hall have?", "When is kelmet served?",
             "What is in kelmet?", "Who was Idris Kell?", "What kind of country is Zorbia?",
             "Which city has glass bridges?", "What is the national dish of Zorbia?"]


def test_sixteen_concurrent_blend_streams_equal_their_answers_asked_alone_in_float32(smol):
    """No KV mixing between requests batched together (in bfloat16 batching itself may change a few
    answers: the README's serving notes)."""
    key = "shared-key"
    ask = dict(model="acme", max_tokens=12, extra_body={"ragcache": {"top_k": 2}})
    alone = [client(smol, key).chat.completions.create(messages=user(q), **ask).choices[0].message.content.strip()
             for q in QUESTIONS]

    async def one(ac: openai.AsyncOpenAI, q: str) -> str:
        stream = await ac.chat.completions.create(messages=user(q), stream=True, **ask)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]).strip()

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{smol.url}/v1", api_key=key, max_retries=0, timeout=600) as ac:
            return await asyncio.gather(*(one(ac, q) for q in QUESTIONS))

    assert asyncio.run(together()) == alone


def test_a_stopped_server_has_written_every_lookup_and_its_log_holds_no_third_party_noise(smol):
    """Closing the server's AsyncBlendEngine (its engine core a child process) writes the store's
    lookup counts to the counter file, as closing a BlendEngine does: every chunk lookup the server
    counted is in the file once it stopped (the self-check's lookups are in neither). Its log, the
    server's process and the engine's, holds none of vLLM's, torch's or Python's warnings."""
    from ragcache.kvstore.ledger import COUNTER_FILE, CounterFile
    from tests.test_demo import NOISE

    client(smol, "ops-key-9").chat.completions.create(model="beta", messages=user("What is kelmet?"), max_tokens=2,
                                                     extra_body={"ragcache": {"top_k": 3}})
    served = sum(v for (n, ls), v in scrape(smol, "ops-key-9").items()
                 if n == "ragcache_chunk_lookups_total" and ("tier", "cpu") in ls)  # every lookup tries cpu first
    smol.stop()
    counted = CounterFile(smol.log.parent / "kv" / COUNTER_FILE).read()["lookups"]
    assert counted["lookups"] == served > 0, (counted, served)
    log = smol.log.read_text()
    noisy = [line for line in log.splitlines() if any(word in line for word in NOISE)]
    assert noisy == [], log[-4000:]
