#!/usr/bin/env bash
# Wheels for `bash benchmarks/gpu_session.sh OUT unsloth` on a GPU machine without network, into
# .whl-unsloth/ (keep it out of git: add /.whl-unsloth/ to .git/info/exclude). Run from the repo root.
set -euo pipefail
dest=.whl-unsloth
../shared/tools/device-wheels.sh --dest "$dest" unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 \
  datasets==4.8.5 dill multiprocess xxhash requests urllib3 idna charset_normalizer certifi einops \
  msgspec pillow bitsandbytes==0.50.2
# Unsloth's from_pretrained imports bitsandbytes even for 16-bit loads; the GPU image has CUDA 13, so
# keep only those of its libraries (43 MB -> 7 MB, inside the 64 MiB a device call may carry).
python3 - "$dest" <<'PY'
import glob, os, sys, zipfile
for whl in glob.glob(os.path.join(sys.argv[1], "bitsandbytes-*.whl")):
    drop = lambda n: n.startswith("bitsandbytes/libbitsandbytes_") and "cuda13" not in n
    tmp = whl + ".tmp"
    with zipfile.ZipFile(whl) as z, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for n in z.namelist():
            if drop(n):
                continue
            data = z.read(n)
            if n.endswith(".dist-info/RECORD"):
                data = b"".join(l + b"\n" for l in data.splitlines() if not drop(l.split(b",")[0].decode()))
            out.writestr(z.getinfo(n), data)
    os.replace(tmp, whl)
    print(f"slimmed {os.path.basename(whl)}: {os.path.getsize(whl) / 1e6:.1f} MB")
PY
rm -rf "$dest/self" && python3 -m pip wheel . --no-deps -q -w "$dest/self"
du -sh "$dest"
