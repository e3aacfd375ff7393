#!/bin/sh
# Makes .venv with Python 3.12 (JAX >= 0.11 needs it) and installs jaxkv into it, editable, with the
# extras named as arguments (test, cuda13, cuda12). README's two commands start with it, and so does
# CI, through the test command verbatim.
#
# Python 3.12 is found as a working `python3.12`, else under pyenv (where the plain `python3.12`
# shim fails unless told the version), else in the usual prefixes.
set -eu
cd "$(dirname "$0")/.."
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python=$(command -v "$candidate")
    break
  fi
done
if [ -z "${python:-}" ]; then
  echo "jaxkv needs Python 3.12 (JAX >= 0.11): none found as python3.12, under pyenv or in /usr." >&2
  echo "Install one (for example: pyenv install 3.12) and run this again." >&2
  exit 1
fi
echo "python 3.12: $python" >&2
extras=$(echo "$*" | tr ' ' ',')
"$python" -m venv .venv
.venv/bin/pip install -q -e ".${extras:+[$extras]}"
