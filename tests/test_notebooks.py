"""The book's standards, checked on every stored chapter (strict nbval then re-executes each one)."""

import ast
import builtins
import re

import pytest
from layout import (
    CHAPTERS,
    HARDWARE,
    KERNELS,
    ROOT,
    TIMING,
    UNCOMPARED,
    WIDGET,
    book_module,
    chapter_tests,
    load,
    repository_url,
    source,
    tags,
    toc_files,
)

STEMS = sorted(CHAPTERS)


def data_names(code: str) -> set[str]:
    """The names a cell binds or reads, less Python's builtins: what a later cell can make claims about."""
    names = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
    return names - set(dir(builtins)) - {"display"}


def imported_names(code: str) -> set[str]:
    nodes = [n for n in ast.walk(ast.parse(code)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return {(a.asname or a.name).split(".")[0] for n in nodes for a in n.names}


def used_names(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_every_chapter_is_in_the_toc_and_mapped():
    on_disk = sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
    assert on_disk == STEMS, "every chapter needs an entry in tests/layout.py CHAPTERS"
    assert [f"chapters/{s}" for s in STEMS] == [f for f in toc_files() if f.startswith("chapters/")]
    for stem, core in CHAPTERS.items():
        assert book_module(stem).exists(), f"{stem}: the chapter needs its book module {book_module(stem).name}"
        assert chapter_tests(stem).exists(), f"{stem}: the chapter needs its tests {chapter_tests(stem).name}"
        tests = chapter_tests(stem).read_text()
        for module in core:
            path = ROOT / "src" / "gradaccum" / module
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), (stem, module)
        assert f"ch{stem}" in tests, f"{chapter_tests(stem).name} must test {book_module(stem).name}"
        assert any(re.search(rf"\b{m}\b", tests) for m in core), f"{chapter_tests(stem).name} must test the core"


@pytest.mark.parametrize("stem", STEMS)
def test_outputs_are_stored_from_one_top_to_bottom_run(stem):
    cells = [c for c in code_cells(load(stem)) if source(c).strip()]
    counts = [c["execution_count"] for c in cells]
    assert None not in counts, "code cells without stored outputs: nbval would not check them (run make outputs)"
    assert counts == list(range(1, len(cells) + 1)), "outputs must come from one fresh top-to-bottom run"


@pytest.mark.parametrize("stem", STEMS)
def test_no_errors_warnings_or_skips(stem):
    for c in code_cells(load(stem)):
        for out in c.get("outputs", []):
            assert out["output_type"] != "error", source(c)
            assert not (out["output_type"] == "stream" and out["name"] == "stderr"), f"stderr in: {source(c)}"
        assert "nbval-skip" not in tags(c) and "NBVAL_SKIP" not in source(c), "never skip a cell"
        assert not source(c).rstrip().endswith(";"), "a trailing ; does not suppress output under nbval"


@pytest.mark.parametrize("stem", STEMS)
def test_the_cells_whose_output_is_not_compared_are_listed_with_a_reason(stem):
    """Strict nbval compares every cell's output but those listed in tests/layout.py UNCOMPARED, each with its
    reason; such a cell makes no claim, and a measurement's claims are asserted in the code cell after it."""
    cells = code_cells(load(stem))
    ignored = {c.get("id"): i for i, c in enumerate(cells) if "nbval-ignore-output" in tags(c)}
    assert set(ignored) == set(UNCOMPARED[stem]), "list every ignored cell (and only those) in UNCOMPARED"
    imported = {name for c in cells for name in imported_names(source(c))}
    for cell_id, i in ignored.items():
        reason = UNCOMPARED[stem][cell_id]
        assert reason in (WIDGET, TIMING, KERNELS, HARDWARE), cell_id
        assert "assert" not in source(cells[i]), "a cell whose output is not compared must not make a claim"
        if reason == WIDGET:
            assert "explorer(" in source(cells[i]) or "interactive" in source(cells[i]), cell_id
        if reason == KERNELS:
            names = data_names(source(cells[i])) - imported
            checks = [source(c) for c in cells[i + 1 :] if "assert" in source(c)]
            assert any(names & used_names(check) for check in checks), f"{cell_id}: assert its claims in a later cell"


@pytest.mark.parametrize("stem", STEMS)
def test_claims_exercises_and_checkers(stem):
    nb = load(stem)
    text = "\n".join(source(c) for c in nb["cells"])
    assert any("assert" in source(c) for c in code_cells(nb)), "the chapter's claims are asserted in code"
    exercises = re.findall(r"```\{exercise\}[^\n]*\n:label: (\S+)", text)
    assert len(exercises) == len(re.findall(r"```\{exercise\}", text)) > 0, "every exercise has a label"
    solved = re.findall(r"```\{solution\}\s*(\S+)", text)
    assert sorted(solved) == sorted(exercises), "every exercise has one solution, and every solution its exercise"
    folded = re.findall(r"```\{solution\}[^\n]*\n:class: dropdown", text)
    assert len(folded) == len(solved), "solutions are folded away"
    assert re.search(r"exercises\.grade_\w+\(", text), "at least one auto-checked exercise"
    assert "## In your framework" in text and "## Checklist" in text
    assert "{cite}" in text


@pytest.mark.parametrize("stem", STEMS)
def test_first_cell_sets_up_and_installs_on_colab(stem):
    first = code_cells(load(stem))[0]
    assert {"hide-cell", "remove-cell"} & set(tags(first))
    assert "gradaccum.setup(" in source(first) and "google.colab" in source(first)
    assert repository_url() in source(first), "the Colab install URL must match _config.yml's repository"


@pytest.mark.parametrize("stem", STEMS)
def test_figures_have_captions_and_alt_text(stem):
    for c in code_cells(load(stem)):
        has_png = any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
        if has_png:
            meta = c["metadata"].get("mystnb", {})
            assert meta.get("figure", {}).get("caption") and meta["figure"].get("name"), source(c)
            assert meta.get("image", {}).get("alt"), source(c)
            assert source(c).rstrip().endswith("plt.show()"), "end figure cells with plt.show()"


@pytest.mark.parametrize("stem", STEMS)
def test_widgets_leave_a_picture_for_static_readers(stem):
    nb = load(stem)
    if not any("ipywidgets" in source(c) for c in code_cells(nb)):
        pytest.skip("no widget in this chapter")
    state = nb["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    outputs = [o for w in state.values() if w["model_name"] == "OutputModel" for o in w["state"].get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "run make outputs to store the widget's picture"


def test_code_cells_fit_the_page_and_are_formatted():
    """Code cells fit the 80-character column the page shows, and ruff's formatter would change nothing."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    for stem in STEMS:
        for c in code_cells(load(stem)):
            long = [line for line in source(c).split("\n") if len(line) > 80]
            assert not long, f"{stem}: lines wider than the page: {long[:2]}"
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in requirements.txt: make install brings it"
    proc = subprocess.run(
        [ruff, "format", "--check", "--line-length", "80", *(str(ROOT / "chapters" / f"{s}.ipynb") for s in STEMS)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("stem", STEMS)
def test_the_page_shows_the_code_it_studies(stem):
    """Each chapter includes the core lines it discusses from the package's own source (one source: the page cannot
    drift from the package), 10–60 lines in all, each include resolving to a core module's object."""
    from gradaccum.book import course

    text = "\n".join(source(c) for c in load(stem)["cells"] if c["cell_type"] == "markdown")
    found = course.INCLUDE.findall(text)
    assert found, "include the package code the chapter studies with ```{literalinclude} ../src/gradaccum/…"
    assert text.count("{literalinclude}") == len(found), "every literalinclude has the form course.INCLUDE reads"
    lines = sum(len(course.package_source(module, obj).splitlines()) for module, obj in found)
    assert 10 <= lines <= 60, lines
    for module, _ in found:
        assert not module.startswith("book"), "the page shows core code, not the book's plumbing"


@pytest.mark.parametrize("stem", STEMS)
def test_widget_ids_are_stable(stem):
    """Stored widget model ids are the canonical ones ``make outputs`` writes (they depend on the notebook and the
    models' places only), so re-executing a chapter does not rewrite every id."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    nb = load(stem)
    assert nb["metadata"]["widgets"][module.WIDGET_STATE]["state"], "the chapter stores its widget state"
    canonical = module.stable_widget_ids(nb, stem)
    assert json.dumps(canonical, sort_keys=True) == json.dumps(nb, sort_keys=True)
    state = nb["metadata"]["widgets"][module.WIDGET_STATE]["state"]
    references = set(re.findall(r"IPY_MODEL_([0-9a-f]{32})", json.dumps(state)))
    assert references <= set(state), "every widget a widget refers to is stored"


@pytest.mark.parametrize("stem", STEMS)
def test_tabular_results_are_tables_not_aligned_text(stem):
    """A printed block whose lines are split into three or more space-aligned columns is a table in disguise: on
    the page it cannot wrap, align or scroll. Display a gradaccum.book.tables.Table instead (HTML on the page,
    aligned text for nbval)."""
    for c in code_cells(load(stem)):
        for out in c.get("outputs", []):
            if out["output_type"] == "stream":
                lines = "".join(out["text"]).split("\n")
                columns = [line for line in lines if len(re.findall(r"\S {2,}\S", line)) >= 2]
                assert len(columns) < 4, f"a text table in: {source(c)[:200]}"
