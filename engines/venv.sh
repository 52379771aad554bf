#!/usr/bin/env bash
# Create (or reuse) the venv of one serving engine and print its path: `engines/venv.sh sglang`.
#
# Engines pin other torch builds than kvbucket's test venv, so each gets its own venv, installed
# from PyPI (and pip's local wheels) through constraints-<engine>.txt. The venv lives in a cache
# directory named by a hash of this script and the engine's pin files, so fresh clones (CI) on the
# same machine reuse it: $KVBUCKET_ENGINE_VENVS, default ~/.cache/kvbucket/engine-venvs.
# A `.complete` stamp is written last: a half-built venv is rebuilt, never used.
set -euo pipefail
engine="${1:?usage: engines/venv.sh sglang}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cons="$root/constraints-$engine.txt"
reqs="$here/$engine-requirements.txt"
[ -f "$cons" ] && [ -f "$reqs" ] || { echo "no pins for engine '$engine' ($cons, $reqs)" >&2; exit 2; }
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
hash="$(cat "$0" "$cons" "$reqs" | sha256sum | cut -c1-12)"
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
  "${pip[@]}" -r "$reqs" >&2
  echo "$(( $(date +%s) - start ))" > "$venv/.build-seconds"
  touch "$venv/.complete"
fi
ln -sfn "$venv" "$root/.venv-$engine" 2>/dev/null || true
echo "$venv"
