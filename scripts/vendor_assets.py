"""Fetch the site's front-end assets from the npm registry into _vendor/ (served as the site's _static/),
pinned and verified.

The site must work offline (or behind a firewall, or when a CDN is down): MathJax 3 renders the formulas from the
site's own _static/ folder. (The widgets need no front-end package: each is plain HTML and a few lines of script,
gradaccum.book.widgets.Explorer.)
Each package is pinned to a version and to the registry's sha512 integrity; only the files the pages use are
extracted, with the package's licence. The result is committed (tests/test_vendor.py checks every file against
VENDORED.json), so building the book needs no network; run this only to change a version.

Usage: python scripts/vendor_assets.py [--check]
  --check   download and compare with what is committed, without writing.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / "_vendor"
MANIFEST = DEST / "VENDORED.json"

#: package → (version, npm sha512 integrity, files to keep: paths inside the tarball's package/ folder, or a folder/)
PACKAGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "mathjax": (
        "3.2.2",
        "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
        ("LICENSE", "es5/tex-chtml-full.js", "es5/output/chtml/fonts/woff-v2/"),
    ),
}


def tarball_url(name: str, version: str) -> str:
    return f"https://registry.npmjs.org/{name}/-/{name.split('/')[-1]}-{version}.tgz"


def fetch(name: str) -> dict[str, bytes]:
    """The kept files of one pinned package, after checking the tarball against its integrity."""
    version, integrity, keep = PACKAGES[name]
    with urllib.request.urlopen(tarball_url(name, version), timeout=120) as response:
        data = response.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != integrity:
        raise SystemExit(f"{name}@{version}: integrity mismatch ({digest} != {integrity}); refusing to vendor it.")
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            path = member.name.removeprefix("package/")
            if member.isfile() and any(path == k or (k.endswith("/") and path.startswith(k)) for k in keep):
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[f"{name.split('/')[-1]}/{path}"] = extracted.read()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = parser.parse_args(argv)
    files: dict[str, bytes] = {}
    for name in PACKAGES:
        files.update(fetch(name))
    manifest = {
        "packages": {name: {"version": v, "integrity": i} for name, (v, i, _) in PACKAGES.items()},
        "files": {path: hashlib.sha256(content).hexdigest() for path, content in sorted(files.items())},
    }
    if args.check:
        committed = json.loads(MANIFEST.read_text())
        same = committed == manifest
        print("vendored assets match the pinned packages" if same else "vendored assets differ: run without --check")
        return 0 if same else 1
    for path, content in files.items():
        target = DEST / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(files)} files ({sum(map(len, files.values())) / 1e6:.1f} MB) under {DEST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
