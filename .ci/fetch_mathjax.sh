#!/usr/bin/env bash
# Fetch MathJax 3 (the npm package's es5 folder, licence and package.json) into
# .ci/cache/mathjax, or into the folder given as the first argument. Needs npm (Node.js).
# The book's build then loads MathJax from that copy instead of the CDN, so the HTML in
# _build/html reads offline (chapters/_ext/local_mathjax.py); tests/book/test_site.py uses it too.
set -euo pipefail
version=3.2.2   # the pages otherwise load mathjax@3 (the latest 3.x) from the CDN
dest=${1:-"$(cd "$(dirname "$0")" && pwd)/cache/mathjax"}
if grep -qs "\"version\": \"$version\"" "$dest/package.json" && [ -f "$dest/es5/tex-mml-chtml.js" ]; then
  echo "MathJax $version already in $dest"
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "fetch_mathjax.sh needs npm (Node.js), e.g. apt-get install npm" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "mathjax@$version" >/dev/null)   # npm checks the registry's checksum
rm -rf "$dest" && mkdir -p "$dest"
tar -xzf "$tmp/mathjax-$version.tgz" -C "$dest" --strip-components=1 \
  package/es5 package/LICENSE package/package.json
echo "MathJax $version in $dest"
