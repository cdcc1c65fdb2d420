"""How the book makes claims (issue: errata): every number an exercise solution states is recomputed by a named
unit test; no assert compares a thing with itself; the errata page lists every correction and stays."""

import ast
import re

import pytest
from layout import CHAPTERS, ROOT, load, source

#: Exercise solutions that state numbers → the unit test that recomputes every one of them.
SOLUTION_TESTS: dict[str, str] = {
    "ex-ch1-effective-momentum": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch1-corrected-momentum": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch1-biased-variance": "tests/test_ch01_microbatch_statistics.py::test_exercise_solutions_numbers",
    "ex-ch2-precise": "tests/test_ch02_ghost_batchnorm.py::test_precise_bn_exercise_solution",
    "ex-ch3-inflate": "tests/test_ch03_clip_ordering.py::test_worked_examples",
    "ex-ch3-scaler": "tests/test_ch03_clip_ordering.py::test_exercise_scaler_clip_before_unscale",
    "ex-ch3-running": "tests/test_ch03_clip_ordering.py::test_exercise_running_buffer_from_the_issue",
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
    # a solution that states a number and is not listed here fails test_solution_numbers_are_tested
}

_NUMBER = re.compile(r"(?<![\w.^{_])\d+\.\d+|\d+(?:\.\d+)?\s*%")


def solutions() -> list[tuple[str, str, str]]:
    """(chapter stem, solution label, solution text) for every solution directive in the chapters."""
    found = []
    for stem in sorted(CHAPTERS):
        for cell in load(stem)["cells"]:
            text = source(cell)
            for match in re.finditer(r"```\{solution\}\s*(\S+)\n(.*?)```", text, flags=re.S):
                found.append((stem, match.group(1), match.group(2)))
    return found


def test_every_chapter_has_solutions():
    assert len(solutions()) >= 3 * len(CHAPTERS)


@pytest.mark.parametrize("stem, label, text", solutions(), ids=[s[1] for s in solutions()])
def test_solution_numbers_are_tested(stem, label, text):
    numbers = _NUMBER.findall(text)
    if not numbers:
        return
    assert label in SOLUTION_TESTS, f"{stem}: solution {label} states {numbers[:5]}: name the test that computes them"
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


def test_errata_page_lists_the_corrections():
    text = (ROOT / "errata.md").read_text()
    entries = re.findall(r"^### ", text, flags=re.M)
    assert len(entries) >= 17
    for heading in ("## Wrong", "## Misleading"):
        assert heading in text
    assert text.count("**Said") >= 15 and text.count("**True") >= 15, "each entry: what was said, what is true"
    assert "errata" in (ROOT / "_toc.yml").read_text()
    assert not re.search(r"HELPER_|NITS\b|EXACT_DETAILS", text), "unfinished placeholders"
