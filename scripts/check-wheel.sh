#!/usr/bin/env bash
# The path a user takes, not the checkout's: build the wheel, check that every module of
# lmtier/ and connectors/ is in it, install it (not editable) with the server extra into a
# venv of its own, and start `lmtier serve` from that venv until its health service
# answers SERVING. Part of `make test`. The venv is reused between runs (its dependencies
# stay); the wheel is reinstalled every time, which removes whatever an older one held.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
OUT=build/wheel-check
pip=(--quiet --disable-pip-version-check)

# A build as a user makes it, over what an earlier build left in build/ (setup.py starts
# from a fresh build/lib: the wheel must hold the sources' modules, no more, no fewer).
rm -rf "$OUT/dist" "$OUT/run"
mkdir -p "$OUT/dist" "$OUT/run"
"$VENV/bin/python" -m pip wheel "${pip[@]}" --no-deps --no-build-isolation -w "$OUT/dist" . >/dev/null
wheel=$(ls "$OUT"/dist/lmtier-*.whl)

"$VENV/bin/python" - "$wheel" <<'EOF'
import sys, zipfile
from pathlib import Path

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = {f"lmtier/{p.relative_to('lmtier')}" for p in Path("lmtier").rglob("*.py")}
want |= {f"lmtier/connectors/{p.relative_to('connectors')}" for p in Path("connectors").rglob("*.py")}
missing = sorted(w for w in want if w not in names and "__pycache__" not in w)
if missing:
    sys.exit("check-wheel: the wheel lacks " + ", ".join(missing))
stale = sorted(n for n in names if n.endswith(".py") and n.startswith("lmtier/") and n not in want)
if stale:  # a module the sources no longer have (an old name would load it, not its warned alias)
    sys.exit("check-wheel: the wheel holds modules the sources do not: " + ", ".join(stale))
strays = sorted({n.split("/")[0] for n in names} - {"lmtier"} - {n.split("/")[0] for n in names if ".dist-info/" in n})
if strays:
    sys.exit("check-wheel: the wheel installs top-level names besides lmtier: " + ", ".join(strays))
print(f"check-wheel: {len(want)} modules in {Path(sys.argv[1]).name}")
EOF

[[ -x "$OUT/venv/bin/python" ]] || "$PYTHON" -m venv "$OUT/venv"
install() {  # pip's output only when it fails
    "$OUT/venv/bin/python" -m pip install "${pip[@]}" "$@" >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
}
install "$wheel[server]"
install --force-reinstall --no-deps "$wheel"

cd "$OUT/run"  # away from the checkout: `import lmtier` must find the installed wheel
../venv/bin/lmtier serve --port 0 --metrics-port 0 >server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
../venv/bin/python - <<'EOF'
import re, sys, time
from pathlib import Path

import grpc
import lmtier
from lmtier.server.health import SERVING, check

if "wheel-check/venv" not in lmtier.__file__:
    sys.exit(f"check-wheel: lmtier imported from {lmtier.__file__}, not from the wheel's venv")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    found = re.search(r"listening on [^:]+:(\d+)", Path("server.log").read_text())
    if found:
        with grpc.insecure_channel(f"127.0.0.1:{found[1]}") as channel:
            status = check(channel, timeout=2)
        if status == SERVING:
            print(f"check-wheel: lmtier serve from the wheel is serving on port {found[1]}")
            sys.exit(0)
    time.sleep(0.2)
sys.exit("check-wheel: lmtier serve from the wheel did not become ready:\n" + Path("server.log").read_text()[-3000:])
EOF
kill -TERM $server
wait $server || { echo "check-wheel: lmtier serve did not stop cleanly:"; tail -20 server.log; exit 1; }
trap - EXIT
