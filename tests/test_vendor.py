"""The site's vendored front-end assets (scripts/vendor_assets.py) are exactly the pinned packages' files."""

import hashlib
import json

from layout import ROOT

VENDOR = ROOT / "_vendor"


def test_vendored_files_match_the_manifest():
    manifest = json.loads((VENDOR / "VENDORED.json").read_text())
    files = {str(p.relative_to(VENDOR)) for p in VENDOR.rglob("*") if p.is_file() and p.name != "VENDORED.json"}
    assert files == set(manifest["files"]), "files added or missing: re-run scripts/vendor_assets.py"
    for path, digest in manifest["files"].items():
        assert hashlib.sha256((VENDOR / path).read_bytes()).hexdigest() == digest, path


def test_manifest_matches_the_pins_and_every_package_ships_its_licence():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vendor_assets", ROOT / "scripts" / "vendor_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    manifest = json.loads((VENDOR / "VENDORED.json").read_text())
    assert manifest["packages"] == {n: {"version": v, "integrity": i} for n, (v, i, _) in module.PACKAGES.items()}
    for name in module.PACKAGES:
        assert f"{name.split('/')[-1]}/LICENSE" in manifest["files"], name


def test_the_site_config_uses_the_vendored_copies():
    config = (ROOT / "_config.yml").read_text()
    assert "mathjax_path: mathjax/es5/tex-chtml-full.js" in config and "html_static_path: [_vendor]" in config
    assert "nb_ipywidgets_js: {}" in config, "no widget manager (and no CDN default) on the site"
    assert (VENDOR / "mathjax" / "es5" / "tex-chtml-full.js").exists()
