"""The code of a section of docs/architecture.md, run as a reader would paste it."""

from pathlib import Path


def architecture_example(heading: str, max_lines: int) -> dict:
    """The namespace the first ``python`` block under ``## heading`` defines, run; the block holds
    fewer than ``max_lines`` lines (the page promises a short example)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = doc[doc.index(f"## {heading}\n"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```\n", start)]
    assert len(code.splitlines()) < max_lines, f"the example of {heading!r} stays under {max_lines} lines"
    namespace = {"__name__": heading.lower().replace(" ", "_")}
    exec(compile(code, "docs/architecture.md", "exec"), namespace)
    return namespace
