"""The glossary stays complete and well formed as the lessons grow.

- every term a lesson sets in bold is a glossary term or one of its other spellings;
- every line of the glossary's lists is an entry, and every entry links to a lesson;
- no term or other spelling is defined twice (case aside).

tests/test_lesson_code.py checks the rest: that every link resolves, to a heading where it
names one, and that every term is used in some lesson. Both read the entries the same way
(``glossary_entries``).
"""

import re

from test_lesson_code import GLOSSARY, LESSONS, glossary_entries

# Bold in the lessons is mostly a run-in paragraph title ("**Sum once, after the last
# backward.**"). A title of more than two words is a sentence, not a term, and is skipped;
# a shorter bold span names a thing, and must be a glossary term, unless it is listed here.
# A question ("**Why?**") is skipped too. Leading articles are dropped first ("**The
# zigzag.**" is "zigzag"), and a plural may stand for its singular ("**Ranks.**").
NOT_TERMS = {
    "by columns",  # lesson 4: how W is cut, in the paragraph under the term column-parallel
    "by rows",  # lesson 4: the same for row-parallel
    "mistake",  # lesson 4: "**The mistake.**", the title of a mistake
    "m",  # lesson 5: the symbol m, stressed in "every stage stashes **m** micro-batches"
    "measuring",  # lesson 6: the titles of the idea's four parts
    "communication",
    "compute",
    "dp outermost",  # lesson 7: where the dp groups go, under the term process grid
    "communication volume",  # lesson 7: the name of a plot's panel
    "pipeline last",  # lesson 9: "**The pipeline last**", the last of a ranked list
}
MAX_TERM_WORDS = 2
LEADING = ("the ", "a ", "an ", "one ", "every ")


def spellings():
    """Every term and other spelling of the glossary, lower case."""
    return {s.lower() for _, names, _ in glossary_entries() for s in names}


def bold_spans():
    """(lesson file name, bold text) of every lesson, code left out."""
    spans = []
    for path in sorted(LESSONS.glob("*.md")):
        if path == GLOSSARY:
            continue
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks
        text = re.sub(r"`([^`\n]*)`", r"\1", text)  # inline code keeps its words
        bold = re.findall(r"\*\*(.+?)\*\*", text, re.S)
        spans += [(path.name, " ".join(s.split())) for s in bold]
    return spans


def as_term(span):
    """The term a bold span would name, or None for a question or a title of several words."""
    if span.endswith("?"):
        return None
    term = span.rstrip(".:;,!").lower()
    for word in LEADING:
        if term.startswith(word):
            term = term[len(word):]
    return term if len(term.split()) <= MAX_TERM_WORDS else None


def test_every_bold_term_of_a_lesson_is_in_the_glossary():
    known = spellings()
    terms = [(name, span, as_term(span)) for name, span in bold_spans()]
    terms = [(name, span, t) for name, span, t in terms if t is not None]
    assert len(terms) >= 20, terms  # the lessons' bold terms are found at all
    missing = [f"{name}: **{span}**" for name, span, t in terms
               if t not in known and t.removesuffix("s") not in known and t not in NOT_TERMS]
    assert not missing, ("bold in a lesson but not in lessons/glossary.md (add an entry, or an "
                         f"'also:' spelling, or list a non-term in NOT_TERMS): {missing}")


def test_the_allow_list_holds_only_bold_words_that_are_not_terms():
    """An entry of NOT_TERMS that no lesson bolds any more, or that has become a glossary
    term, would hide a term: it must go."""
    bolded = {as_term(span) for _, span in bold_spans()}
    assert NOT_TERMS <= bolded, f"no lesson bolds these any more: {NOT_TERMS - bolded}"
    assert not NOT_TERMS & spellings(), f"these are glossary terms now: {NOT_TERMS & spellings()}"


def test_every_glossary_line_is_an_entry_with_a_lesson_link():
    text = re.sub(r"\n  +", " ", GLOSSARY.read_text())  # as glossary_entries joins an entry
    items = [line for line in text.splitlines() if line.startswith("- ")]
    entries = glossary_entries()
    assert len(entries) == len(items), [line[:60] for line in items
                                        if not re.match(r"- \*\*(.+?)\*\*", line)]
    unlinked = [term for term, _, links in entries
                if not any(re.fullmatch(r"\d\d-[\w-]+\.md(#[\w-]+)?", link) for link in links)]
    assert not unlinked, f"glossary entries with no link to a lesson: {unlinked}"


def test_no_glossary_term_is_defined_twice():
    seen, twice = {}, []
    for term, names, _ in glossary_entries():
        for name in names:
            if name.lower() in seen:
                twice.append(f"{name!r} in {seen[name.lower()]!r} and {term!r}")
            seen.setdefault(name.lower(), term)
    assert not twice, f"glossary spellings defined twice (case aside): {twice}"
