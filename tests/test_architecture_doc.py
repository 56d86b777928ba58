"""docs/architecture.md names the package as it is: every module path it names exists, and
every module and subpackage of numpyro_fed appears in its layout."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "numpyro_fed"


def _layout_block() -> str:
    return re.search(r"```\nnumpyro_fed/\n(.*?)```", DOC, re.S).group(1)


def test_every_module_path_the_page_names_exists():
    paths = set(re.findall(r"numpyro_fed/[\w/]+\.py", DOC))
    assert len(paths) >= 20, "the round traces name the files they pass through"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_layout_names_every_module_and_subpackage_and_nothing_else():
    layout = _layout_block()
    named = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*(?:\.py|/))", layout))
    top = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    top |= {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert not sorted(top - named), f"the layout omits {sorted(top - named)}"
    # names in the layout's first column are top-level modules or subpackages that exist
    first = {m for line in layout.splitlines() for m in re.findall(r"^  ([\w.]+(?:\.py|/))", line)}
    assert not sorted(first - top), f"the layout names what does not exist: {sorted(first - top)}"


def test_the_subpackage_files_the_layout_lists_exist():
    layout = _layout_block()
    current = None
    for line in layout.splitlines():
        head, sub = re.match(r"^  (\w+)/", line), re.match(r"^    (\w+)/", line)
        if head:
            top = current = PACKAGE / head.group(1)
        elif sub:  # a subpackage of the last top-level one (flower/runtime/)
            current = top / sub.group(1)
        if current is None or not line.strip():
            continue
        for name in re.findall(r"(\w+)\.py", line):
            assert (current / f"{name}.py").is_file() or (PACKAGE / f"{name}.py").is_file(), (
                f"docs/architecture.md lists {name}.py under {current.name}/, which has no such module")


def test_the_library_imports_none_of_its_examples():
    """The demo, datasets and ready-made models live in numpyro_fed_examples, outside the
    library's import path: no module of numpyro_fed names it, and importing numpyro_fed loads
    none of it."""
    naming = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                    if "numpyro_fed_examples" in p.read_text())
    assert not naming, f"library modules that name the examples: {naming}"
    code = "import sys, numpyro_fed; print(sorted(m for m in sys.modules if m.startswith('numpyro_fed_examples')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
