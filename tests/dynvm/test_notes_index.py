"""docs/NOTES.md is the index of every named note (scripts/notes_index.py writes it):
current, every citation in the repository resolves to a header, and every note is cited
somewhere besides its header (a note nobody points at is a note nobody finds)."""

from __future__ import annotations

import importlib.util
import sys

from tests.dynvm._shipped import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("notes_index",
                                                  REPO / "scripts" / "notes_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


NOTES = _generator()


def test_notes_md_is_current():
    written = (REPO / "docs" / "NOTES.md").read_text()
    assert written == NOTES.render(), ("docs/NOTES.md is stale: run "
                                       "python scripts/notes_index.py --write")


def test_every_citation_has_a_header_and_every_note_a_citation():
    names = [header.name for header in NOTES.headers()]
    cited = NOTES.citations()
    assert len(names) == len(set(names)), "a note name is written twice"
    assert len(names) > 100 and "Bounded JSON" in names   # the scan sees them
    assert not sorted(set(cited) - set(names)), "cited, never written"
    assert not sorted(set(names) - set(cited)), "written, never cited"


def test_a_note_header_and_its_first_sentence_are_read(tmp_path):
    note = "Note"   # spelt apart: this file's own text is scanned for citations
    text = (f'"""Doc.\n\n{note} [Odd name]\n~~~~~~~~~~~~~~\nFirst one. Second one.\n"""\n'
            f"# {note} [Other]\n# ~~~~~~~~~~~~\n# A comment note\n# over two lines. More.\n")
    found = [(m.group(1), NOTES._first_sentence(text, m.end()))
             for m in NOTES.HEADER.finditer(text)]
    assert found == [("Odd name", "First one."),
                     ("Other", "A comment note over two lines.")]
