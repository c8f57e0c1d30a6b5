#!/usr/bin/env bash
# The docs site's home page and one concept page, as headless Chromium renders them
# (docs/screenshots/*.png). Needs: pip install -e '.[docs]' and a chromium on the PATH
# (Debian: apt-get install chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q --site-dir "$SITE"
PORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$SITE" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER; rm -rf "$SITE"' EXIT
sleep 1
mkdir -p docs/screenshots
for page in "index.html:home" "zero-guide/index.html:zero-guide"; do
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
        --screenshot="docs/screenshots/${page##*:}.png" "http://127.0.0.1:$PORT/${page%%:*}"
done
