"""How the book makes claims: the unit test that recomputes an exercise solution's numbers is named beside it (and
exists); no assert compares a thing with itself; the Corrections page (errata.md) gives every correction in one
line, and the full record of how each was found stays in CHANGELOG.md, outside the site."""

import ast
import re

import pytest
from layout import CHAPTERS, ROOT, load, source

#: Exercise solutions that state numbers → the unit test that recomputes them.
SOLUTION_TESTS: dict[str, str] = {
    "ex-ch1-effective-momentum": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch1-corrected-momentum": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch1-biased-variance": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch2-precise": "tests/test_ch02_ghost_batchnorm.py::test_precise_bn_exercise_solution",
    "ex-ch3-inflate": "tests/test_ch03_clip_ordering.py::test_worked_examples",
    "ex-ch3-scaler": "tests/test_ch03_clip_ordering.py::test_exercise_scaler_clip_before_unscale",
    "ex-ch3-running": "tests/test_ch03_clip_ordering.py::test_exercise_running_buffer_solution",
    "ex-ch4-subnormal": "tests/test_exercises.py::test_smallest_positive_solution_is_computed",
    "ex-ch4-backoff": "tests/test_ch04_mixed_precision_scaling.py::test_backoff_exercise_solution",
    "ex-ch4-bf16-where": "tests/test_ch04_mixed_precision_scaling.py::test_bf16_accumulator_exercise_solution",
    "ex-ch5-saving": "tests/test_ch05_no_sync.py::test_ring_and_saving_exercises",
    "ex-ch6-tokens": "tests/test_exercises.py::test_window_token_exercise_solution",
    "ex-ch6-partial": "tests/test_ch06_loss_normalization_and_friends.py::test_partial_step_ratio",
    "ex-ch7-warmup": "tests/test_ch07_frameworks.py::test_exercise_solution_numbers",
    "ex-ch7-partial": "tests/test_ch07_frameworks.py::test_exercise_solution_numbers",
    "ex-ch7-tokens": "tests/test_ch07_frameworks.py::test_exercise_solution_numbers",
    "ex-ch8-negatives": "tests/test_ch08_beyond_batchnorm.py::test_exercise_solution_numbers",
    "ex-ch8-momentum": "tests/test_ch08_beyond_batchnorm.py::test_exercise_solution_numbers",
    "ex-ch8-switch": "tests/test_ch08_beyond_batchnorm.py::test_exercise_solution_numbers",
}


def solutions() -> list[tuple[str, str, str]]:
    """(chapter stem, solution label, solution text) for every solution directive in the chapters."""
    found = []
    for stem in sorted(CHAPTERS):
        for cell in load(stem)["cells"]:
            text = source(cell)
            for match in re.finditer(r"```\{solution\}\s*(\S+)\n(.*?)```", text, flags=re.S):
                found.append((stem, match.group(1), match.group(2)))
    return found


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_every_solution_fence_is_read(stem):
    """solutions() misses none of a chapter's solutions (a fence it cannot parse would drop out of every check)."""
    fences = sum(source(cell).count("```{solution}") for cell in load(stem)["cells"])
    assert len([s for s in solutions() if s[0] == stem]) == fences


@pytest.mark.parametrize("label", sorted(SOLUTION_TESTS))
def test_the_test_named_for_a_solution_exists(label):
    """Each pointer from a solution to the test that recomputes its numbers leads somewhere: the solution is in a
    chapter and the test is defined in its file."""
    assert label in {s[1] for s in solutions()}, f"{label}: no solution has this label"
    path, name = SOLUTION_TESTS[label].split("::")
    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), flags=re.M), SOLUTION_TESTS[label]


def _asserts(stem: str):
    for cell in load(stem)["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse(source(cell))
        except SyntaxError:  # IPython magics: none in this book, but never crash the check
            continue
        yield from (node for node in ast.walk(tree) if isinstance(node, ast.Assert))


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_no_assert_compares_a_thing_with_itself(stem):
    for node in _asserts(stem):
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            dumped = [ast.dump(s) for s in sides]
            assert len(set(dumped)) == len(dumped), (
                f"{stem}: assert compares an expression with itself: {ast.unparse(node)}"
            )


#: The reader's Corrections page: at most this many words (counted as below).
CORRECTIONS_MAX_WORDS = 2000

#: Review-round bookkeeping that belongs in CHANGELOG.md, not on the reader's page.
_BOOKKEEPING = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
    r"\s+(?:reviews?|rounds?)\b"
    r"|\breview\s+rounds?\b|\brounds?\s+of\s+reviews?\b|\bentr(?:y|ies)\s+\d",
    re.I,
)


def _sections(text: str) -> dict[str, str]:
    """The page's ``## `` groups: heading → body."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _items(text: str) -> list[str]:
    """Each top-level bullet with its indented continuation lines, joined."""
    found = re.findall(r"^- .*(?:\n  .*)*", text, flags=re.M)
    return [" ".join(line.strip() for line in item.splitlines()) for item in found]


def test_errata_page_is_a_readers_corrections_page():
    """errata.md is the reader's Corrections page: short, one line per correction (what was said → what is true),
    grouped by chapter; no test names and no review rounds (those are in CHANGELOG.md, which the site leaves out)."""
    text = (ROOT / "errata.md").read_text()
    assert text.startswith("# Corrections\n")
    words = len(re.findall(r"[A-Za-z0-9']+", text))
    assert words <= CORRECTIONS_MAX_WORDS, f"the Corrections page has {words} words (at most {CORRECTIONS_MAX_WORDS})"
    sections = _sections(text)
    for n in range(1, 9):
        heading = f"Chapter {n}"
        assert heading in sections, f"no '## {heading}' group"
        assert _items(sections[heading]), f"'## {heading}' lists no correction"
        assert f"{{doc}}`chapters/0{n}_" in sections[heading], f"'## {heading}' does not link its chapter"
    for item in _items(text):
        assert "→" in item, f"a correction line says what was said → what is true: {item[:80]}"
    assert "test_" not in text, "the reader's page names no test (CHANGELOG.md has them)"
    found = _BOOKKEEPING.search(text)
    assert found is None, f"review-round bookkeeping on the reader's page: {found.group(0)!r}"
    assert not re.search(r"HELPER_|NITS\b|EXACT_DETAILS", text), "unfinished placeholders"
    toc = (ROOT / "_toc.yml").read_text()
    assert re.search(r"^\s*- file: errata\s*$", toc, flags=re.M) and "CHANGELOG" not in toc


def test_changelog_keeps_the_full_record_outside_the_site():
    changelog = ROOT / "CHANGELOG.md"
    assert changelog.exists(), "the full record of how each correction was found"
    record = changelog.read_text()
    assert "How each correction was found" in record and "**Said" in record
    config = (ROOT / "_config.yml").read_text()
    patterns = re.search(r"^exclude_patterns:\s*\[(.*)\]\s*$", config, flags=re.M)
    assert patterns is not None, "_config.yml has no one-line exclude_patterns list"
    assert "CHANGELOG.md" in [p.strip().strip("\"'") for p in patterns.group(1).split(",")], (
        "the site must not build CHANGELOG.md: add it to exclude_patterns"
    )
