"""The guide's contents list every section, and its options table every
keyword argument of ``Evaluator`` and ``Evaluator.spawn``: checked here
against the headings and the signatures, so that neither drifts when a
section or an option is added."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import shmeval

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped
    (hyphens and underscores kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """{heading: its body} of every ## and ### section (not those inside
    code blocks)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    parts = re.split(r"^(#{2,3}) (.+)$", text, flags=re.M)
    return {parts[i + 1].strip(): parts[i + 2] for i in range(1, len(parts) - 2, 3)}


def contents(text: str) -> list[tuple[str, str]]:
    """The contents list at the top: (title, link target) per entry."""
    top = text.split("\n## ", 1)[0]
    return re.findall(r"^\s*- \[(.+?)\]\(#(.+?)\)", top, flags=re.M)


def test_contents_list_every_section() -> None:
    text = GUIDE.read_text()
    headings = list(sections(text))
    listed = contents(text)
    anchors = {anchor(h): h for h in headings}
    missing = [h for h in headings if anchor(h) not in {a for _, a in listed}]
    assert not missing, f"sections missing from the guide's contents: {missing}"
    dangling = [a for _, a in listed if a not in anchors]
    assert not dangling, f"contents entries without a section: {dangling}"
    order = [anchors[a] for _, a in listed]
    assert order == [h for h in headings if h in order], "contents out of the sections' order"


def option_names(table_section: str) -> set[str]:
    """The names in the first column of the section's first table."""
    rows = [line for line in table_section.splitlines() if line.startswith("|")]
    names: set[str] = set()
    for row in rows[2:]:
        names.update(re.findall(r"`(\w+)`", row.split("|")[1]))
    return names


def keyword_parameters() -> set[str]:
    names = set()
    for f in (shmeval.Evaluator.__init__, shmeval.Evaluator.spawn):
        names.update(p.name for p in inspect.signature(f).parameters.values()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return names


def test_options_table_lists_every_keyword_argument() -> None:
    documented = option_names(sections(GUIDE.read_text())["Options"])
    expected = keyword_parameters()
    assert expected - documented == set(), (
        f"keyword arguments of Evaluator / Evaluator.spawn missing from the guide's "
        f"options table: {sorted(expected - documented)}")
    assert documented - expected == set(), (
        f"the guide's options table lists what no signature takes: "
        f"{sorted(documented - expected)}")


def test_statistics_tables_list_every_key() -> None:
    """Every key of ``stats()`` (a thread evaluator with a cache, after a
    request, so that ``cache``, ``client_spin`` and ``tuner`` are there)
    is in the guide's statistics table, and every key of its ``tuner``
    entry in the tuner's."""
    import numpy as np

    def model(batch: np.ndarray) -> np.ndarray:
        return batch.reshape(len(batch), -1).sum(axis=1)

    with shmeval.Evaluator(model, input_shape=(3,), outputs={"v": ((), "float32")},
                           cache_entries=16) as ev:
        ev.evaluate(np.zeros(3, np.float32))
        st = ev.stats()
    guide = sections(GUIDE.read_text())
    missing = set(st) - option_names(guide["Statistics"])
    assert not missing, f"stats() keys missing from the guide's statistics table: {sorted(missing)}"
    tuner = option_names(guide["The tuner: no knobs"].split("`ev.stats()[\"tuner\"]`", 1)[1])
    missing = set(st["tuner"]) - tuner
    assert not missing, f"stats()['tuner'] keys missing from the guide's tuner table: {sorted(missing)}"
