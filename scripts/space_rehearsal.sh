#!/usr/bin/env bash
# Rehearse a Hugging Face Space's Gradio-SDK build and start on a clean clone, reading only the files its builder
# reads, and fail naming the step where a Space would fail:
#
#   scripts/space_rehearsal.sh [REPOSITORY]      # default: this checkout (its committed HEAD)
#
#   1. front matter  README.md's YAML header: sdk gradio, sdk_version, app_file, python_version
#   2. push          every file over 10 MiB is covered by an LFS pattern (the Hub refuses it otherwise)
#   3. apt           packages.txt, if any, with apt-get
#   4. pip           a new venv with NO pip configuration (PIP_CONFIG_FILE=/dev/null, no PIP_* variables):
#                    pre-requirements.txt, then requirements.txt, from PyPI and PyTorch's CPU index
#   5. sdk install   the builder's own unhashed `pip install "gradio[oauth]==<sdk_version>" "uvicorn>=0.14.0"
#                    spaces`, which must change nothing the lock installed
#   6. start         app_file as user 1000 (when run as root), a fresh HOME (so no compile cache), port and
#                    server name from the environment; the page must answer within START_LIMIT_S
#   7. visit         tools/space_check.py in Chromium: the page answers, a Run streams 4 panels, the charts draw
#
# PyTorch's CPU index cannot be reached from the project's machines: a local simple index holding the one torch
# wheel pre-requirements.txt pins stands in for it (the URL is swapped in a copy of that file, nothing else is).
# The wheel is ASTRAI_TORCH_WHEEL, else found in pip's configured find-links folders. PyPI is the real one.
# Exit 0: passed; 1: a Space would fail (the step is named); 3: this machine cannot rehearse it (said why).
# The visit runs with CHECK_PYTHON (default: python3 on PATH), which needs Playwright and Debian's chromium.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SOURCE="${1:-$REPO}"
START_LIMIT_S="${START_LIMIT_S:-15}"
CHECK_PYTHON="${CHECK_PYTHON:-python3}"
TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORK="$(mktemp -d)"
chmod 755 "$WORK"  # user 1000 runs the venv's python and reads the app in here
APP_PID=""
STEP="clone"
say() { echo "[space_rehearsal] $*" >&2; }
fail() { say "FAILED at step '$STEP': $*"; exit 1; }
cannot() { say "cannot rehearse here, at step '$STEP': $*"; exit 3; }  # not the Space's fault: exit 3
clean_up() {
  status=$?
  if [ -n "$APP_PID" ]; then kill -- "-$APP_PID" 2>/dev/null || kill "$APP_PID" 2>/dev/null || true; fi
  if [ "$status" -ne 0 ] && [ -f "$WORK/app.log" ]; then say "the app's last lines:"; tail -30 "$WORK/app.log" >&2; fi
  rm -rf "$WORK"
  exit "$status"
}
trap clean_up EXIT
STARTED=$SECONDS

git clone -q "$SOURCE" "$WORK/app"
cd "$WORK/app"
say "cloned $(git rev-parse --short HEAD) of $SOURCE"

STEP="front matter"
# shellcheck disable=SC2046
eval "$(python3 - <<'EOF'
import re, shlex, sys
from pathlib import Path

text = Path("README.md").read_text()
match = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
if not match:
    sys.exit("echo 'README.md has no YAML front matter' >&2; exit 1")
fields = dict(re.findall(r"^(\w+):\s*\"?([^\"\n]*?)\"?\s*$", match.group(1), flags=re.M))
for key in ("sdk", "sdk_version", "app_file", "python_version"):
    print(f"FM_{key.upper()}={shlex.quote(fields.get(key, ''))}")
EOF
)"
[ "$FM_SDK" = gradio ] || fail "sdk is '$FM_SDK'; this rehearsal is of the Gradio SDK"
[ -n "$FM_SDK_VERSION" ] || fail "no sdk_version"
[ -f "$FM_APP_FILE" ] || fail "app_file '$FM_APP_FILE' is not in the repository"
# A Space runs its app as user 1000: as root, rehearse that with a Python user 1000 can run (a pyenv under /root is
# not one); where there is none, or this is not root, the app runs as this user, and the line says so.
AS_USER=()
PYTHON=""
# A venv's python links to its base interpreter, which the new venv links to in turn: judge the resolved binary.
for candidate in "/usr/local/bin/python$FM_PYTHON_VERSION" "/usr/bin/python$FM_PYTHON_VERSION" \
  "$(command -v "python$FM_PYTHON_VERSION" || true)"; do
  [ -x "$candidate" ] || continue
  candidate=$(readlink -f "$candidate")
  if [ "$(id -u)" -ne 0 ]; then PYTHON=$candidate; break; fi
  if setpriv --reuid=1000 --regid=1000 --clear-groups "$candidate" -c "import venv" 2>/dev/null; then
    PYTHON=$candidate
    AS_USER=(setpriv --reuid=1000 --regid=1000 --clear-groups)
    break
  fi
  [ -n "$PYTHON" ] || PYTHON=$candidate
done
[ -n "$PYTHON" ] || cannot "python_version $FM_PYTHON_VERSION: no python$FM_PYTHON_VERSION here to rehearse with"
say "front matter: gradio $FM_SDK_VERSION, $FM_APP_FILE, Python $FM_PYTHON_VERSION ($PYTHON)"

STEP="push"
while IFS= read -r -d '' path; do
  size=$(stat -c %s "$path")
  if [ "$size" -gt $((10 * 1024 * 1024)) ] && [ "$(git check-attr filter -- "$path" | sed 's/.*: //')" != lfs ]; then
    fail "$path is $size bytes, over the Hub's 10 MiB, and no LFS pattern in .gitattributes covers it"
  fi
done < <(git ls-files -z)
say "push: every file over 10 MiB goes through LFS"

STEP="apt"
if [ -f packages.txt ]; then
  mapfile -t PACKAGES < <(grep -v '^\s*#' packages.txt | tr -s ' \t' '\n' | grep -v '^$')
  missing=()
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || fail "apt-get could not install ${missing[*]}"
  fi
  say "apt: ${PACKAGES[*]} installed"
fi

STEP="pip"
for variable in $(env | grep -o '^PIP_[A-Z_]*' || true); do unset "$variable"; done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m venv "$WORK/venv"
if [ "${#AS_USER[@]}" -gt 0 ] && ! "${AS_USER[@]}" "$WORK/venv/bin/python" -c pass 2>/dev/null; then
  cannot "user 1000 cannot run the venv's python (made from $PYTHON)"
fi
PIP=("$WORK/venv/bin/python" -m pip)
if [ -f pre-requirements.txt ]; then
  grep -q "$TORCH_INDEX" pre-requirements.txt || fail "pre-requirements.txt does not name PyTorch's CPU index"
  torch_pin=$(grep -oE '^torch==[^ ]+' pre-requirements.txt) || fail "pre-requirements.txt pins no torch"
  version=${torch_pin#torch==}
  wheel="${ASTRAI_TORCH_WHEEL:-}"
  if [ -z "$wheel" ]; then
    for dir in $(env -u PIP_CONFIG_FILE python3 -m pip config get global.find-links 2>/dev/null || true); do
      for candidate in "$dir"/torch-"$version"-cp"${FM_PYTHON_VERSION/./}"-*x86_64.whl; do
        [ -f "$candidate" ] && wheel=$candidate
      done
    done
  fi
  [ -f "$wheel" ] || cannot "no torch $version wheel to stand in for PyTorch's index (set ASTRAI_TORCH_WHEEL)"
  mkdir -p "$WORK/pytorch-index/torch"
  name=$(basename "$wheel")
  printf '<!DOCTYPE html><html><body><a href="file://%s">%s</a></body></html>\n' "${wheel//+/%2B}" "$name" \
    >"$WORK/pytorch-index/torch/index.html"
  sed "s#$TORCH_INDEX#file://$WORK/pytorch-index#" pre-requirements.txt >"$WORK/pre-requirements.txt"
  "${PIP[@]}" install -q -r "$WORK/pre-requirements.txt" || fail "pip install -r pre-requirements.txt"
  say "pip: pre-requirements.txt installed ($torch_pin from the stand-in for $TORCH_INDEX)"
fi
"${PIP[@]}" install -q -r requirements.txt || fail "pip install -r requirements.txt"
say "pip: requirements.txt installed"

STEP="sdk install"
"${PIP[@]}" freeze --all >"$WORK/before.txt"
"${PIP[@]}" install -q "gradio[oauth]==$FM_SDK_VERSION" "uvicorn>=0.14.0" spaces \
  || fail "the builder's own pip install of gradio[oauth]==$FM_SDK_VERSION"
"${PIP[@]}" freeze --all >"$WORK/after.txt"
if ! changed=$(diff "$WORK/before.txt" "$WORK/after.txt"); then
  fail "the builder's gradio install changed what the lock installed: $(echo "$changed" | grep '^[<>]' | tr '\n' ' ')"
fi
say "sdk install: gradio[oauth]==$FM_SDK_VERSION, uvicorn and spaces were already as the lock installed them"

STEP="start"
mkdir -p "$WORK/home"
PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
[ "${#AS_USER[@]}" -eq 0 ] || chown -R 1000:1000 "$WORK/app" "$WORK/home"
mkdir -p "$WORK/home/tmp"  # a Space's /tmp is new too: no Gradio or inductor files of earlier runs
launched=$(date +%s%N)
setsid "${AS_USER[@]}" env -i PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin" HOME="$WORK/home" USER=user \
  TMPDIR="$WORK/home/tmp" PYTHONUNBUFFERED=1 SYSTEM=spaces GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT="$PORT" \
  "$WORK/venv/bin/python" "$FM_APP_FILE" >"$WORK/app.log" 2>&1 &
APP_PID=$!
until curl -sf -o /dev/null "http://127.0.0.1:$PORT/"; do
  kill -0 "$APP_PID" 2>/dev/null || fail "$FM_APP_FILE ended before it served"
  [ $(($(date +%s%N) - launched)) -gt 300000000000 ] && fail "the page did not answer within 300 s"
  sleep 0.2
done
answered_ms=$((($(date +%s%N) - launched) / 1000000))
answered="$((answered_ms / 1000)).$(printf '%03d' $((answered_ms % 1000)))"
say "start: the page answered $answered s after the process started (as uid $([ "${#AS_USER[@]}" -gt 0 ] && echo 1000 || id -u), $PYTHON, fresh HOME, port $PORT)"
[ "$answered_ms" -le $((START_LIMIT_S * 1000)) ] || fail "the page took $answered s, over $START_LIMIT_S s"

STEP="visit"
(cd "$WORK/app" && "$CHECK_PYTHON" -m tools.space_check "http://127.0.0.1:$PORT/") || fail "see space_check's line above"
grep -E "compiled|eager" "$WORK/app.log" | tail -3 | sed 's/^/[space_rehearsal] app log: /' >&2 || true
say "passed in $((SECONDS - STARTED)) s: a Space built from this commit builds, starts and serves the lesson"
