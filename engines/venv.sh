#!/usr/bin/env bash
# Create (or reuse) the venv of one serving engine and print its path: `engines/venv.sh sglang`.
#
# Engines pin other torch builds than kvbucket's test venv, so each gets its own venv, installed
# from PyPI (and pip's local wheels) through constraints-<engine>.txt. The venv lives in a cache
# directory named by a hash of this script and the engine's pin files, so fresh clones (CI) on the
# same machine reuse it: $KVBUCKET_ENGINE_VENVS, default ~/.cache/kvbucket/engine-venvs.
# A `.complete` stamp is written last: a half-built venv is rebuilt, never used.
#
# kvbucket's own dependencies come from its metadata (pyproject.toml's [project].dependencies
# and the extras in $kvb_extras), never from a hand-kept copy, under the engine's pins; the venv
# is checked before it is stamped: every one of them installed at a version kvbucket allows, and
# the compiled Xet decoder (kvbucket.stores.hub.xet.kernel, numba) loading.
# `engines/venv.sh sglang --requirements` prints what would be installed, builds nothing.
set -euo pipefail
engine="${1:?usage: engines/venv.sh sglang [--requirements]}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cons="$root/constraints-$engine.txt"
reqs="$here/$engine-requirements.txt"
[ -f "$cons" ] && [ -f "$reqs" ] || { echo "no pins for engine '$engine' ($cons, $reqs)" >&2; exit 2; }
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
kvb_extras="encryption"  # the extras a user installs kvbucket with next to an engine
kvb_deps="$("$py" - "$root/pyproject.toml" $kvb_extras <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
print("\n".join(project["dependencies"] + [d for e in sys.argv[2:] for d in extras[e]]))
EOF
)"
if [ "${2:-}" = "--requirements" ]; then
  grep -vE '^\s*(#|$)' "$reqs"
  echo "$kvb_deps"
  exit 0
fi
hash="$( { cat "$0" "$cons" "$reqs"; echo "$kvb_deps"; } | sha256sum | cut -c1-12)"
base="${KVBUCKET_ENGINE_VENVS:-$HOME/.cache/kvbucket/engine-venvs}"
venv="$base/$engine-$hash"
mkdir -p "$base"
exec 9>"$base/$engine.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  start=$(date +%s)
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$cons")
  pkg="$(grep -iE "^$engine==" "$cons")"
  # The engine itself without its dependencies (GPU kernels, servers, ...); then exactly what its
  # storage path imports, pinned.
  "${pip[@]}" --no-deps "$pkg" >&2
  echo "$kvb_deps" > "$venv/kvbucket-requirements.txt"
  "${pip[@]}" -r "$reqs" -r "$venv/kvbucket-requirements.txt" >&2
  PYTHONPATH="$root/src" "$venv/bin/python" - "$venv/kvbucket-requirements.txt" >&2 <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
bad = []
for line in open(sys.argv[1]).read().splitlines():
    if not line.strip():
        continue
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate():
        continue
    try:
        v = version(r.name)
    except PackageNotFoundError:
        bad.append(f"{r.name} is not installed")
        continue
    if not r.specifier.contains(v, prereleases=True):
        bad.append(f"{r.name} {v} is not {r.specifier}")
from kvbucket.stores.hub.xet.decode import compiled
if compiled() is None:
    bad.append("the compiled Xet decoder (kvbucket.stores.hub.xet.kernel) does not load")
if bad:
    sys.exit("the engine venv lacks what kvbucket needs: " + "; ".join(bad))
print("kvbucket's dependencies and the compiled Xet decoder: ok")
EOF
  echo "$(( $(date +%s) - start ))" > "$venv/.build-seconds"
  touch "$venv/.complete"
fi
ln -sfn "$venv" "$root/.venv-$engine" 2>/dev/null || true
echo "$venv"
