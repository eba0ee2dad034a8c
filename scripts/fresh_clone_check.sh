#!/usr/bin/env bash
# What a new user gets: a fresh clone in a new virtualenv, and README's two commands from "On a fresh machine",
# exactly as README writes them (read from it, not copied here). The app's command must serve its page; it is then
# stopped, and the test command runs. Exit 0 when both did; the output ends with pytest's summary line.
#
#   scripts/fresh_clone_check.sh [REPOSITORY]     # default: this checkout (its committed HEAD, not uncommitted work)
#
# The tests that need a vLLM server or fleet skip unless the environment names them (README says how).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SOURCE="${1:-$REPO}"
WORK="$(mktemp -d)"
APP_GROUP=""
clean_up() {
  if [ -n "$APP_GROUP" ]; then kill -- "-$APP_GROUP" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap clean_up EXIT
say() { echo "[fresh_clone_check] $*" >&2; }

STARTED=$SECONDS
git clone -q "$SOURCE" "$WORK/checkout"
cd "$WORK/checkout"
say "cloned $(git rev-parse --short HEAD) of $SOURCE into $WORK/checkout"
python3 -m venv "$WORK/venv"
# shellcheck disable=SC1091
source "$WORK/venv/bin/activate"

# README's bash blocks under "## On a fresh machine": the first installs and runs the app, the second the tests.
mapfile -t COMMANDS < <(python scripts/readme_commands.py)
[ "${#COMMANDS[@]}" -eq 2 ] || { say "README's 'On a fresh machine' lacks its two commands"; exit 1; }
say "the app's command: ${COMMANDS[0]}"
say "the tests' command: ${COMMANDS[1]}"

PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
GRADIO_SERVER_PORT="$PORT" setsid bash -c "${COMMANDS[0]}" >"$WORK/app.log" 2>&1 &
APP_GROUP=$!
until curl -sf -o /dev/null "http://127.0.0.1:$PORT/"; do
  if ! kill -0 "$APP_GROUP" 2>/dev/null; then
    say "the app's command ended before serving; its output:"
    tail -40 "$WORK/app.log" >&2
    exit 1
  fi
  if [ $((SECONDS - STARTED)) -gt 900 ]; then
    say "the app did not serve within 900 s"
    exit 1
  fi
  sleep 2
done
say "the app served http://127.0.0.1:$PORT/ after $((SECONDS - STARTED)) s (install and start)"
kill -- "-$APP_GROUP"
wait "$APP_GROUP" 2>/dev/null || true
APP_GROUP=""

bash -c "${COMMANDS[1]}"
