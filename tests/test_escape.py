"""pipeline/escape.py: for arbitrary strings, what each destination's rule writes is parsed by a real
CommonMark/GFM parser (markdown-it-py, its GFM-like preset: tables, strikethrough, linkify) and must add
no link, image, mention, issue reference, heading, table row or cell, math or HTML element, and must still
read as the string itself; the terminal rule leaves no control character raw.

GitHub links @mentions, #12 / GH-12 references and emoji in the text after parsing (they are no markdown,
so no parser knows them); `live` looks for them in the parsed text as GitHub's filters would. Math: GitHub
renders `$...$` inside one run of text (a backslash does not stop it), so no text run may hold a `$`
other than the `<span>$</span>` that GitHub documents for a literal one.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeline import escape

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# pieces that mean something to markdown, to GitHub or to a terminal, mixed with arbitrary text
PIECES = ["@octocat", "@", "#12", "#", "GH-7", "gh-7", "$", "$$", "$x$", "$`y`$", "www.", "www.evil.example",
          "https://evil.example/x", "http:", "//", "mailto:a@b.co", "a@b.co", "[", "]", "(", ")", "](", "![", "<",
          ">", "<img src=x>", "<!--", "-->", "<span>", "</span>", "&", "&lt;", "&#36;", "&#64;", "|", "||", "\\",
          "\\|", "`", "```", "~~", "~", "*", "**", "_", "__", ":", ":tada:", "-", "+", "=", "===", "---", "1.",
          "1)", "#", "###", ">", " ", "  ", "    ", "\t", "\n", "\r", "\r\n", "\x1b[31m", "\x1b]8;;http://x\x07",
          "\x08", "\x00", "\x7f", "\x9b", "\u202e", "\u200b", "\u2028", "\ufeff", "::error::", "##[group]", "a", "Z",
          "0", "9", "é", "中", "\U0001f600", "x_y", "snake_case", "2026-10-22", "03:48:16", ":100:", ":1234:", ":+1:",
          "xmpp:", "MailTo:", "ftp://", "py:name"]
TEXT = st.one_of(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.text(max_size=40),
                 st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=10).map("".join))


def parser():
    import linkify_it  # noqa: F401 - without it markdown-it leaves `linkify` None: skip (conftest), not error
    from markdown_it import MarkdownIt

    md = MarkdownIt("gfm-like")  # commonmark + tables + strikethrough + linkify, HTML on
    # as GitHub: no bare domain and no protocol-relative //host is a link (its www. links are checked below)
    md.linkify.set({"fuzzy_link": False})
    md.linkify.add("//", None)
    return md


MD = parser()
# what GitHub turns into something live in the text itself
GITHUB_TEXT = {
    "mention": re.compile(r"@[A-Za-z0-9]"),
    "issue reference": re.compile(r"#[0-9]"),
    "GH- reference": re.compile(r"(?i)gh-[0-9]"),
    "www. link": re.compile(r"(?i)www\."),
    "URL": re.compile(r"(?i)(?:https?|ftp)://|(?:mailto|xmpp):[A-Za-z0-9._+-]"),
    # GitHub's emoji names: none is digits alone but 100 and 1234 (so a time, 03:48:16, is no emoji)
    "emoji": re.compile(r":(?:(?![0-9]+:)[a-z0-9_+-]+|100|1234):"),
}
ALLOWED_HTML = {"<span>", "</span>"}
# an address GitHub links (the GFM spec's extended email autolink): these characters only, a dot in the domain
GFM_EMAIL = re.compile(r"[A-Za-z0-9.+_-]+@[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)+")


def _flat(tokens):
    for t in tokens:
        yield t
        if t.children:
            yield from _flat(t.children)


def live(markdown: str, *, allowed_html: set[str] = ALLOWED_HTML) -> list[str]:
    """Everything in `markdown` that would be more than text on GitHub, apart from the structure the
    caller checks itself (tables, headings)."""
    found = []
    tokens = MD.parse(markdown)
    flat = list(_flat(tokens))
    for i, t in enumerate(flat):
        if t.type == "link_open" and t.markup == "linkify" and t.attrs.get("href", "").startswith("mailto:") \
                and not GFM_EMAIL.fullmatch(flat[i + 1].content):
            continue  # linkify-it counts a zero-width space as a letter of an address; GFM does not (below)
        if t.type in ("link_open", "image", "code_inline", "em_open", "strong_open", "s_open", "html_block",
                      "blockquote_open", "bullet_list_open", "ordered_list_open", "hr", "code_block",
                      "math_inline", "math_block"):
            found.append(f"{t.type} {t.content!r}")
        elif t.type == "html_inline" and t.content not in allowed_html:
            found.append(f"html {t.content!r}")
    for t in tokens:
        if t.type != "inline":
            continue
        kids = t.children or []
        runs, run = [], []
        for i, k in enumerate(kids):
            dollar = (k.type == "text" and k.content == "$" and 0 < i < len(kids) - 1
                      and kids[i - 1].content == "<span>" and kids[i + 1].content == "</span>")
            if k.type in ("text", "softbreak") and not dollar:
                run.append(k.content if k.type == "text" else "\n")
            else:
                runs.append("".join(run))
                run = []
        runs.append("".join(run))
        for text in runs:
            if "$" in text:
                found.append(f"math: a $ in the text run {text!r}")
            for what, pattern in GITHUB_TEXT.items():
                if pattern.search(text):
                    found.append(f"{what} in {text!r}")
    return found


def structure(markdown: str) -> dict[str, list]:
    """What a reader's GitHub would make of `markdown` beyond its text: every element (by type, with the
    target of each link and image and the text of each HTML tag) and every mention, reference, URL or
    math that GitHub's text filters would link. Two renderings that differ only in the text of a
    competitor's strings must have the same structure."""
    tokens = MD.parse(markdown)
    elements = []
    for t in _flat(tokens):
        if t.type in ("text", "inline", "softbreak", "hardbreak") or (t.type == "html_inline"
                                                                       and t.content in ALLOWED_HTML):
            continue  # text, and the <span> around a literal $ (pipeline/escape.py's DOLLAR)
        if t.type in ("link_open", "image"):
            elements.append(f"{t.type} {t.attrs.get('href') or t.attrs.get('src')}")
        elif t.type.startswith("html"):
            elements.append(f"{t.type} {t.content.strip()}")
        else:
            elements.append(t.type)
    text = []
    for t in tokens:
        if t.type == "inline":
            depth = 0
            for k in t.children or []:
                depth += k.type == "link_open"
                depth -= k.type == "link_close"
                if k.type == "text" and not depth and k.content != "$":
                    text.append(k.content)
    joined = "\n".join(text)
    linked = [f"{what}: {m.group(0)}" for what, p in GITHUB_TEXT.items() for m in p.finditer(joined)]
    return {"elements": elements, "linked in text": linked, "math": [x for x in text if "$" in x]}


def shown(inline_children) -> str:
    """The text a reader sees of an inline token: text and `<span>$</span>`, the zero-width spaces gone."""
    return "".join(k.content for k in inline_children if k.type == "text").replace(escape.ZWSP, "")


def expected_inline(s: str, limit: int | None = None) -> str:
    t = re.sub(r"[ \t\r\n]+", " ", s).strip()
    t = escape.visible(t)
    plain = escape._PLAIN_NUMBER.fullmatch(t) and not escape._LINE_START.match(t)
    return t if plain else escape._cut(t, limit)


@pytest.mark.parametrize("s", ["1.", "1)", "- x", "+ x", "===", "---", "# h", "> q", "    code", "1. x", "* x"])
def test_the_line_starts_that_open_a_block_stay_text(s):
    md = f"{escape.md_inline(s)} is a submission\n"
    assert [t.type for t in MD.parse(md)] == ["paragraph_open", "inline", "paragraph_close"], md
    md = f"{escape.md_inline(s)}\n"
    assert [t.type for t in MD.parse("text\n" + md)] == ["paragraph_open", "inline", "paragraph_close"], md


def test_the_checker_sees_what_it_must_refuse():
    """Each thing the properties rule out is found when it is written raw (the checks can fail)."""
    for raw in ("[x](https://e.example)", "![p](https://e.example/p.png)", "<img src=x>", "@octocat", "#12", "GH-7",
                "www.evil.example", "https://evil.example", "$x$", "**b**", "`c`", "~~s~~", ":tada:", "a@b.co"):
        assert live(f"| a |\n| --- |\n| {raw} |\n"), raw
    assert len([t for t in MD.parse("| a | b |\n| --- | --- |\n| x | y | z |\n") if t.type == "td_open"]) == 2
    assert [t.type for t in MD.parse("| a |\n| --- |\n| x |\n# h\n")].count("heading_open") == 1


@PROPERTY
@given(TEXT)
def test_a_table_cell_stays_one_inert_cell(s):
    md = f"| a | b |\n| --- | --- |\n| {escape.md_inline(s)} | z |\n"
    tokens = MD.parse(md)
    assert [t.type for t in tokens].count("tr_open") == 2, md  # the header and one row
    assert [t.type for t in tokens].count("td_open") == 2, md
    cells = [t for t in tokens if t.type == "inline"][2:]
    assert shown(cells[0].children) == expected_inline(s, 500), md
    assert shown(cells[1].children) == "z"
    assert not live(md), (md, live(md))


@PROPERTY
@given(TEXT)
def test_a_heading_stays_one_heading_of_text(s):
    md = f"### {escape.md_heading(s)}: PASSED\n\nafter\n"
    tokens = MD.parse(md)
    assert [t.type for t in tokens] == ["heading_open", "inline", "heading_close", "paragraph_open", "inline",
                                        "paragraph_close"], md
    assert shown(tokens[1].children) == (expected_inline(s, 200) + ": PASSED").strip(), md
    assert not live(md), (md, live(md))


@PROPERTY
@given(TEXT)
def test_a_line_of_text_stays_a_line_of_text(s):
    """At the start of a line (a verdict's sentence) and in a list item (a flag)."""
    md = f"{escape.md_inline(s)} is a submission\n"
    assert [t.type for t in MD.parse(md)] == ["paragraph_open", "inline", "paragraph_close"], md
    assert not live(md), (md, live(md))
    md = f"- code: {escape.md_inline(s)}\n"
    types = [t.type for t in MD.parse(md)]
    assert types.count("list_item_open") == 1 and types.count("paragraph_open") == 1, md
    assert live(md) == ["bullet_list_open ''"], (md, live(md))


@PROPERTY
@given(TEXT)
def test_a_code_block_holds_the_text_verbatim_and_closes(s):
    md = escape.md_code_block(s) + "\n\nafter <b>x</b>\n"
    tokens = MD.parse(md)
    fences = [t for t in tokens if t.type == "fence"]
    assert len(fences) == 1, md
    body = escape.visible(s.replace("\r\n", "\n").rstrip("\n"), keep="\n\t")
    assert fences[0].content == body + "\n", md
    assert [t.type for t in tokens][1:4] == ["paragraph_open", "inline", "paragraph_close"], md


@PROPERTY
@given(TEXT)
def test_the_terminal_rule_leaves_no_control_character_raw(s):
    one = escape.terminal(s)
    assert not any(escape._hidden(c) for c in one), repr(one)
    assert not re.match(r"[ \t]*(::|##\[)", one)
    for line in escape.terminal_lines(s):
        assert not any(escape._hidden(c) for c in line if c != "\t"), repr(line)
        assert not re.match(r"[ \t]*(::|##\[)", line), repr(line)
    # nothing is dropped: every character is there or written as its escape
    assert len(one) >= len(s)


def test_the_terminal_shows_a_forged_verdict_for_what_it_is():
    forged = "oops\r\x1b[2K\x1b[1A\x1b[2Kverdict: PASSED\x08\u202e"
    line = escape.terminal(forged)
    assert line == "oops\\r\\x1b[2K\\x1b[1A\\x1b[2Kverdict: PASSED\\x08\\u202e"
    assert escape.terminal_lines("::add-mask::x\n  ::error file=a::forged\nok") == [
        "\\x3a:add-mask::x", "  \\x3a:error file=a::forged", "ok"]


@pytest.mark.parametrize("lang", ["text\nx", "`", "a b"])
def test_a_code_blocks_language_is_ours(lang):
    with pytest.raises(ValueError):
        escape.md_code_block("x", lang)


@pytest.mark.parametrize("text", ["2026-12-07T03:48:16.399Z", "reference/muse_bf16_proj.py:baseline",
                                  "submissions/kernel/muse_bf16_proj/bob/submission.py", "12:00 UTC"])
def test_a_path_or_a_time_reads_and_copies_as_itself(text):
    """What a reader copies out of a comment (a path, a time, a `file.py:name`) holds no invisible character:
    only what GitHub could turn into something live gets its zero-width space."""
    assert escape.md_inline(text) == text and live(escape.md_inline(text)) == []
